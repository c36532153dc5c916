#!/usr/bin/env bash
# Call V (carry [".upstream", ".whl", ".cuda"]): what a user gets from an mmap-ed model with the defaults - fit plans
# the memory (the cache priced with EXPERT_REFILL) - against the same call's hand-set 16 slots (with the refill the
# hand-set default adds), each against upstream's own fit at the same margin; a model of N_LAYER (default 16) layers
# of the 30B-A3B shape (locality routing), decode tg128 @ d2048 paired over LOADS loads (default 2); the fit's plan
# text (alternatives, prediction, guard) first (row `plan`) and in each row's log.
N_LAYER=${N_LAYER:-16} MODEL=q${N_LAYER:-16}-loc SPARE_GIB=${SPARE_GIB:-4} source docs/results/defaults-gpu-2026-12-07/common.sh
D=$OUT/V SHOW='^\| [a-z0-9]|rror|memory:|slots a layer|no cache|guard|expert cache' MIN_LEFT=60; mkdir -p $D
T="-p 0 -n 128 -d 2048 -b 2048 -ub 512 --paired ${PAIRED:-4} --loads ${LOADS:-2}"
one plan fit $M --devices cuda:0 --load-mode mmap --margin $MARGIN -c 4096 -b 2048 -ub 512 --workload tg=128
one default ab $M --devices cuda:0 --load-mode mmap --fit --margin $MARGIN $T
one hand-c16 ab $M --devices cuda:0 --load-mode mmap --fit --margin $MARGIN --expert-cache 16slots $T
tar czf $OUT/V.tgz -C $OUT V && rm -rf $D; echo "call: $(( $(date +%s) - t0 )) s"
