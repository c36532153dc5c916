#!/usr/bin/env bash
# Call E (device run, carry [".upstream", ".whl", ".cuda"]): prompts pp16384 with the defaults on a 16-layer model of
# the 30B-A3B shape (locality routing), ~4 GiB of the GPU for it: `-ub auto` now runs the pairs it predicts close
# to the best and takes the fastest measured; beside it the hand-set LAYER_MAJOR=1 pairs and upstream with its own fit.
# Then decode tg128 @ d2048 with the defaults (each variant its own fit: the patched planner weighs the cache, and
# the hybrid, against resident layers), paired over two loads.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=/tmp/E SHOW='layer major|measured|memory:|^    [ *] n_ubatch|^\| |^patched|^baseline|rror'; mkdir -p $D
one default-pp16384   run $M --devices cuda:0 --margin $MARGIN -p 16384 -n 0 -r 2 -ub auto
one lm1-pp16384       run $M --devices cuda:0 --fit --margin $MARGIN -p 16384 -n 0 -r 2 -b 16384 -ub 1024,2048 --switch LAYER_MAJOR=1
one upstream-pp16384  run $M --devices cuda:0 --variant baseline --fit --margin $MARGIN -p 16384 -n 0 -r 2 -b 16384 -ub 8192
one decode-default    ab $M --devices cuda:0 --fit each --margin $MARGIN -p 0 -n 128 -d 2048 --paired 4 --loads 2
cp -r /tmp/pp_cache/compute /tmp/E/probe 2>/dev/null; rm -f /tmp/E/probe/*.gguf
tar czf $OUT/E.tgz -C /tmp E; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
