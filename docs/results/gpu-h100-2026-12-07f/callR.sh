#!/usr/bin/env bash
# Call R (carry [".upstream", ".whl", ".cuda"]): decode tg128 @ d2048 from an mmap-ed 16-layer model of the 30B-A3B
# shape (locality routing, every expert on host) with 16 cache slots a layer (12.5%), paired over two loads against
# upstream's mmap CPU path: all of a layer's misses but one computed by the host CPU from the page cache (EXPERT_HYBRID
# at its largest), the guard as planned, and no guard. -b 2048 -ub 512: the untimed depth's ubatches (upstream copies
# every host expert from pageable memory for each ubatch of 32 or more: at -ub 32 a round's depth took over a minute,
# and callP's first row ran out of time in its first round).
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=$OUT/R SHOW='guard|^\| |rror' MIN_LEFT=60; mkdir -p $D
T="-p 0 -n 128 -d 2048 -b 2048 -ub 512 --paired 4 --loads 2"
one dec-mmap-c16-cpumiss ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots --switch EXPERT_HYBRID=100000 \
    --switch EXPERT_CACHE_MIN_HIT=0 $T   # (a layer's misses on the host CPU but one: it goes up)
one dec-mmap-c16 ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots $T
one dec-mmap-c16-noguard ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots --switch EXPERT_CACHE_MIN_HIT=0 $T
echo "call: $(( $(date +%s) - t0 )) s"
