#!/usr/bin/env bash
# Call F (right after E; carry [".upstream", ".whl", ".cuda"] in case the machine is fresh): decode tg128 @ d2048 on
# 16-layer models, ~4 GiB of the GPU, paired over two loads: an mmap-ed model with the defaults (each variant its own
# fit: the patched planner prices misses staged through pinned slots) and with 16 slots a layer (12.5%) against
# upstream's CPU path.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=/tmp/F SHOW='memory:|guard|^    \*|^\| |^patched|rror' MIN_LEFT=70; mkdir -p $D
one mmap-default  ab $M --devices cuda:0 --fit each --margin $MARGIN --load-mode mmap -p 0 -n 128 -d 2048 --paired 4 --loads 2
one mmap-16slots  ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots -p 0 -n 128 -d 2048 --paired 4 --loads 2
tar czf $OUT/F.tgz -C /tmp F; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
