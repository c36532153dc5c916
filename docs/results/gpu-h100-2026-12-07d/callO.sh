#!/usr/bin/env bash
# Call O (carry [".upstream", ".whl", ".cuda"]): the staging ring sized to a layer (ggml-backend-pp-staging.cpp):
# prompts pp16384 with LAYER_MAJOR=1 from an mmap-ed 16-layer model of the 30B-A3B shape (locality routing) at 16
# copier threads and the default, then the same pinned and every weight in VRAM (callL's rows, before the change:
# 22,018 / 20,361 / 27,531 / 26,585 t/s). Rows are written under $OUT as they finish.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=$OUT/O SHOW='^patched|^baseline|rror' MIN_LEFT=25; mkdir -p $D
P="-p 16384 -n 0 -r 2 -b 16384"
one lm-mmap-s16  run $M --devices cuda:0 $P -ub 4096 --load-mode mmap --switch LAYER_MAJOR=1 --switch STAGING=16
one lm-mmap      run $M --devices cuda:0 $P -ub 4096 --load-mode mmap --switch LAYER_MAJOR=1
one lm-pinned    run $M --devices cuda:0 $P -ub 4096 --switch LAYER_MAJOR=1
one vram         run $M --devices cuda:0 $P -ub 2048 --variant baseline --host-experts none
echo "call: $(( $(date +%s) - t0 )) s"
