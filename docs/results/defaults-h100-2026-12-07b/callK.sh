#!/usr/bin/env bash
# Call K (carry [".upstream", ".whl", ".cuda"]): callI's mmap defaults again with the guard's bar at the hybrid path's
# break-even (callI: the bar of the cache alone, 75%, sent every layer to the CPU path at 66% hits: 0.83x).
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=/tmp/K SHOW='memory:|guard|^    [ *] |^\| |rror'; mkdir -p $D
one mmap-default  ab $M --devices cuda:0 --fit each --margin $MARGIN --load-mode mmap -p 0 -n 128 -d 2048 --paired 4 --loads 1
tar czf $OUT/K.tgz -C /tmp K; echo "call: $(( $(date +%s) - t0 )) s"
