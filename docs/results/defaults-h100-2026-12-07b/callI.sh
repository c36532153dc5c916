#!/usr/bin/env bash
# Call I (carry [".upstream", ".whl", ".cuda"]): an mmap-ed model with the defaults now that the decode probe measures
# a staged miss (DecodeCosts.miss_gbps): the plan should take no cache or the hybrid, never a loss (>= 1.00x), and
# with 16 slots hand-set beside it; then the same with pinned weights as the control (paired over two loads).
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=/tmp/I SHOW='memory:|guard|^    [ *] |^\| |rror'; mkdir -p $D
one mmap-default  ab $M --devices cuda:0 --fit each --margin $MARGIN --load-mode mmap -p 0 -n 128 -d 2048 --paired 4 --loads 2
one mmap-16slots  ab $M --devices cuda:0 --load-mode mmap --expert-cache 16slots -p 0 -n 128 -d 2048 --paired 2 --loads 1
cp -r /tmp/pp_cache/compute /tmp/I/probe 2>/dev/null; rm -f /tmp/I/probe/*.gguf
tar czf $OUT/I.tgz -C /tmp I; echo "call: $(( $(date +%s) - t0 )) s"
