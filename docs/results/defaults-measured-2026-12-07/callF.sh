#!/usr/bin/env bash
# Call F (right after E; carry [".upstream", ".whl", ".cuda"] in case the machine is fresh): decode tg128 @ d2048 on
# the 16-layer model, ~4 GiB of the GPU: an mmap-ed model with the defaults (each variant its own fit: the patched
# planner prices misses staged through pinned slots) and with 16 slots a layer (12.5%) against upstream's CPU path;
# the decode probe (fit, pinned) and the CPU path of the full model at depth 0 and 2048 (what the probe's replicas
# at depth 0 stand for).
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
mkdir -p /tmp/F
ab() {  # NAME ARGS...: one A/B, its table's last lines
  local name=$1; shift; [ $(left) -lt 70 ] && { echo "== $name skipped: $(left) s left"; return; }
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - 20 )) /tmp/pp "$@" -o /tmp/F/$name > /tmp/F/$name.txt 2>&1
  grep -E "memory:|guard|^    \*|^\| |^patched|rror" /tmp/F/$name.txt | cut -c1-260 | tail -9
}
ab mmap-default  ab $M --devices cuda:0 --fit each --margin $MARGIN --load-mode mmap -p 0 -n 128 -d 2048 --paired 6 --loads 2
ab mmap-16slots  ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots -p 0 -n 128 -d 2048 --paired 6 --loads 2
ab plan-decode   fit $M --devices cuda:0 --margin $MARGIN -c 4096 --workload decode
ab cpu-depth     run $M --devices cuda:0 --expert-cache 0 -p 0 -n 32 -d 0,2048 -r 3
cp -r /tmp/pp_cache/compute /tmp/F/probe 2>/dev/null; rm -f /tmp/F/probe/*.gguf
tar czf $OUT/F.tgz -C /tmp F; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
