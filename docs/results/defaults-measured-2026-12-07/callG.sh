#!/usr/bin/env bash
# Call G (carry [".upstream", ".whl", ".cuda"]): the GPU split in two (GGML_CUDA_DEVICES=2: two devices on one link),
# the 16-layer model, ~2 GiB of each half for it (the margin is per device): the defaults against upstream's own fit
# and the hand-set alternatives, decode tg128 @ d2048 and prompts pp16384.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=/tmp/G SHOW='memory:|layer major|^    \*|^    [ *] n_ubatch|^\| |^patched|^baseline|rror'; mkdir -p $D
export GGML_CUDA_DEVICES=2 CUDA_VISIBLE_DEVICES=0
MS=$(( TOT / 2048 - 2 ))GiB; echo "split margin $MS a device"
one dec-default   ab $M --devices cuda --fit each --margin $MS -p 0 -n 128 -d 2048 -r 3
for s in 16slots 32slots; do
  one dec-$s      run $M --devices cuda --fit --margin $MS -p 0 -n 128 -d 2048 -r 3 --expert-cache $s
done
one pp-default    run $M --devices cuda --margin $MS -p 16384 -n 0 -r 2 -ub auto
one pp-lm         run $M --devices cuda --fit --margin $MS -p 16384 -n 0 -r 2 -b 16384 -ub 2048,4096 --switch LAYER_MAJOR=1
one pp-upstream   run $M --devices cuda --variant baseline --fit --margin $MS -p 16384 -n 0 -r 2 -b 16384 -ub 8192
tar czf $OUT/G.tgz -C /tmp G; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
