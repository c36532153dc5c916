#!/usr/bin/env bash
# Call F (right after E; carry [".upstream", ".whl", ".cuda"] in case the machine is fresh): decode tg128 @ d2048 on
# 16-layer models, ~4 GiB of the GPU, paired over two loads: an mmap-ed model with the defaults (each variant its own
# fit: the patched planner prices misses staged through pinned slots) and with 16 slots a layer (12.5%) against
# upstream's CPU path.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
mkdir -p /tmp/F
one() {  # NAME ARGS...: one pyllama-pp command, its table's last lines
  local name=$1; shift; [ $(left) -lt 70 ] && { echo "== $name skipped: $(left) s left"; return; }
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - 20 )) /tmp/pp "$@" -o /tmp/F/$name > /tmp/F/$name.txt 2>&1
  grep -E "memory:|guard|^    \*|^\| |^patched|rror" /tmp/F/$name.txt | cut -c1-260 | tail -8
}
one mmap-default  ab $M --devices cuda:0 --fit each --margin $MARGIN --load-mode mmap -p 0 -n 128 -d 2048 --paired 4 --loads 2
one mmap-16slots  ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots -p 0 -n 128 -d 2048 --paired 4 --loads 2
tar czf $OUT/F.tgz -C /tmp F; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
