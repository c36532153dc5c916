#!/usr/bin/env bash
# Call H (carry [".upstream", ".whl", ".cuda"]): uniform routing (no locality: the cache's hits are its share of the
# experts), the 16-layer model, ~4 GiB of the GPU: the defaults (each variant its own fit) and 16 slots a layer
# (12.5%) against upstream, decode tg128 @ d2048, paired over two loads.
N_LAYER=16 MODEL=q16-uni SPARE_GIB=4 ROUTING=uniform source docs/results/defaults-gpu-2026-12-07/common.sh
mkdir -p /tmp/H
one() {
  local name=$1; shift; [ $(left) -lt 70 ] && { echo "== $name skipped: $(left) s left"; return; }
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - 20 )) /tmp/pp "$@" -o /tmp/H/$name > /tmp/H/$name.txt 2>&1
  grep -E "memory:|guard|^    \*|^\| |rror" /tmp/H/$name.txt | cut -c1-260 | tail -8
}
one uni-default  ab $M --devices cuda:0 --fit each --margin $MARGIN -p 0 -n 128 -d 2048 --paired 6 --loads 2
one uni-16slots  ab $M --devices cuda:0 --expert-cache 16slots -p 0 -n 128 -d 2048 --paired 6 --loads 2
tar czf $OUT/H.tgz -C /tmp H; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
