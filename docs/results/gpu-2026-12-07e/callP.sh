#!/usr/bin/env bash
# Call P (carry [".upstream", ".whl", ".cuda"]): the staging ring sized to a layer, on a 16-layer model of the 30B-A3B
# shape (locality routing, every expert on host): prompts pp16384 with LAYER_MAJOR=1 from an mmap-ed model at the
# default copier threads (3/4 of the cores) and at 16, pinned, every weight in VRAM; then decode tg128 @ d2048 from an
# mmap-ed model with 16 cache slots a layer (12.5%) paired over two loads against upstream's mmap CPU path, with the
# guard as planned, with all of a layer's misses but one computed by the host CPU from the page cache (EXPERT_HYBRID
# at its largest), and without the guard (EXPERT_CACHE_MIN_HIT=0). Rows are written under $OUT as they finish.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=$OUT/P SHOW='guard|^\| |^patched|^baseline|rror' MIN_LEFT=25; mkdir -p $D
P="-p 16384 -n 0 -r 2 -b 16384"
one lm-mmap      run $M --devices cuda:0 $P -ub 4096 --load-mode mmap --switch LAYER_MAJOR=1
one lm-pinned    run $M --devices cuda:0 $P -ub 4096 --switch LAYER_MAJOR=1
one vram         run $M --devices cuda:0 $P -ub 2048 --variant baseline --host-experts none
T="-p 0 -n 128 -d 2048 --paired 4 --loads 2"
one dec-mmap-c16-cpumiss ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots --switch EXPERT_HYBRID=100000 \
    --switch EXPERT_CACHE_MIN_HIT=0 $T   # (a layer's misses on the host CPU but one: it goes up)
one dec-mmap-c16 ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots $T
one dec-mmap-c16-noguard ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots --switch EXPERT_CACHE_MIN_HIT=0 $T
one lm-mmap-s16  run $M --devices cuda:0 $P -ub 4096 --load-mode mmap --switch LAYER_MAJOR=1 --switch STAGING=16
echo "call: $(( $(date +%s) - t0 )) s"
