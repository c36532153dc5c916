#!/usr/bin/env bash
# Call T (carry [".upstream", ".whl", ".cuda"]): decode tg128 @ d2048 from an mmap-ed 16-layer model of the 30B-A3B
# shape (locality routing, every expert on host), paired over two loads against upstream's mmap CPU path: every miss
# on the host CPU with EXPERT_REFILL=1 / 2 (the first misses of a token copied into slots after the CPU's share, by the
# CPU's graph), against the same call's "all but one on the CPU" (EXPERT_HYBRID at its largest, the one staged before
# the device computes); 16 slots a layer (12.5%), then 32 (25%) with EXPERT_REFILL=1.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=$OUT/T SHOW='^\| [a-z0-9]|rror' MIN_LEFT=60; mkdir -p $D
T="-p 0 -n 128 -d 2048 -b 2048 -ub 512 --paired 4 --loads 2"
H="--load-mode mmap --switch EXPERT_HYBRID=100000 --switch EXPERT_CACHE_MIN_HIT=0"
one refill1-c16 ab $M --devices cuda:0 $H --expert-cache 16slots --switch EXPERT_REFILL=1 $T
one cpumiss-c16 ab $M --devices cuda:0 $H --expert-cache 16slots $T
one refill2-c16 ab $M --devices cuda:0 $H --expert-cache 16slots --switch EXPERT_REFILL=2 $T
one refill1-c32 ab $M --devices cuda:0 $H --expert-cache 32slots --switch EXPERT_REFILL=1 $T
tar czf $OUT/T.tgz -C $OUT T && rm -rf $D; echo "call: $(( $(date +%s) - t0 )) s"
