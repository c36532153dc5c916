#!/usr/bin/env bash
# Call S (carry [".upstream", ".whl", ".cuda"]): the staging ring sized to a layer on the whole 48-layer 30B-A3B preset
# (locality routing, every expert on host; 81.3% of in VRAM from an mmap-ed model before the ring): prompts pp16384
# with LAYER_MAJOR=1 from an mmap-ed model, every weight in VRAM, then pinned where time is left.
N_LAYER=48 MODEL=q30-loc source docs/results/defaults-gpu-2026-12-07/common.sh
D=$OUT/S SHOW='^patched|^baseline|rror' MIN_LEFT=40; mkdir -p $D
P="-p 16384 -n 0 -r 2 -b 16384"
one lm-mmap   run $M --devices cuda:0 $P -ub 4096 --load-mode mmap --switch LAYER_MAJOR=1
one vram      run $M --devices cuda:0 $P -ub 2048 --variant baseline --host-experts none
one lm-pinned run $M --devices cuda:0 $P -ub 4096 --switch LAYER_MAJOR=1
echo "call: $(( $(date +%s) - t0 )) s"
