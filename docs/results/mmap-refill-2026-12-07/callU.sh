#!/usr/bin/env bash
# Call U (carry [".upstream", ".whl", ".cuda"]): callT.sh cut to what ~200 s of device time holds - an 8-layer model of
# the 30B-A3B shape from mmap, 16 slots a layer: EXPERT_REFILL=1 first, then all on the CPU but one, each paired over
# one load (4 rounds) against upstream's mmap CPU path.
N_LAYER=8 MODEL=q8-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=$OUT/U SHOW='^\| [a-z0-9]|rror' MIN_LEFT=45; mkdir -p $D
T="-p 0 -n 128 -d 2048 -b 2048 -ub 512 --paired 4 --loads 1"
H="--load-mode mmap --switch EXPERT_HYBRID=100000 --switch EXPERT_CACHE_MIN_HIT=0 --expert-cache 16slots"
one refill1-c16 ab $M --devices cuda:0 $H --switch EXPERT_REFILL=1 $T
one cpumiss-c16 ab $M --devices cuda:0 $H $T
tar czf $OUT/U.tgz -C $OUT U && rm -rf $D; echo "call: $(( $(date +%s) - t0 )) s"
