#!/usr/bin/env bash
# Call H (right after callE.sh and callG.sh of defaults-measured-2026-12-07, carry [".upstream", ".whl", ".cuda"]):
# what G could not run as written (its hand-set split rows did not fit at -b 16384), and F's mmap defaults, shorter.
# Ran in two calls: first pp-up-split (and a pp-lm-split at -b 16384 -ub 1024,2048, which did not fit either),
# then mmap-default and pp-lm-split as below.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=/tmp/H SHOW='memory:|guard|layer major|^    [ *] n_ubatch|^    \*|^\| |^patched|^baseline|rror'; mkdir -p $D
MIN_LEFT=150 one mmap-default  ab $M --devices cuda:0 --fit each --margin $MARGIN --load-mode mmap -p 0 -n 128 -d 2048 --paired 4 --loads 2
( export GGML_CUDA_DEVICES=2 CUDA_VISIBLE_DEVICES=0; MS=$(( TOT / 2048 - 2 ))GiB
  one pp-up-split   run $M --devices cuda --variant baseline --fit --margin $MS -p 16384 -n 0 -r 2 -b 16384 -ub 2048,4096
  one pp-lm-split   run $M --devices cuda --fit --margin $MS -p 16384 -n 0 -r 2 -b 8192 -ub 2048,4096 --switch LAYER_MAJOR=1 )
tar czf $OUT/H.tgz -C /tmp H; echo "call: $(( $(date +%s) - t0 )) s"
