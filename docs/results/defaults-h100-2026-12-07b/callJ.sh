#!/usr/bin/env bash
# Call J (carry [".upstream", ".whl", ".cuda"]): uniform routing with the defaults, where the cache should not pay: a
# 24-layer model of the 30B-A3B shape with `--routing uniform`, ~6 GiB of the GPU; decode tg128 @ d2048 paired over two
# loads (each variant its own fit), then prompts pp8192 with the defaults (the plan must never lose: >= 1.00x).
N_LAYER=24 MODEL=q24-uni ROUTING=uniform SPARE_GIB=6 source docs/results/defaults-gpu-2026-12-07/common.sh
D=/tmp/J SHOW='memory:|guard|^    [ *] |^\| |rror' MIN_LEFT=90; mkdir -p $D
one uni-decode  ab $M --devices cuda:0 --fit each --margin $MARGIN -p 0 -n 128 -d 2048 --paired 4 --loads 2
one uni-prompt  ab $M --devices cuda:0 --margin $MARGIN -p 8192 -n 0 -ub auto -r 2   # (the plan of -ub auto, both variants)
tar czf $OUT/J.tgz -C /tmp J; echo "call: $(( $(date +%s) - t0 )) s"
