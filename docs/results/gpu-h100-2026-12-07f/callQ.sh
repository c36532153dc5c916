#!/usr/bin/env bash
# Call Q (carry [".upstream", ".whl", ".cuda"]), after callP on the same machine (its 16-layer model kept): decode
# tg128 @ d2048 split in two (GGML_CUDA_DEVICES=2, one link) on the 16-layer model of the 30B-A3B shape with locality
# routing, every expert in pinned host RAM - the CPU path, the cache alone and the misses split (EXPERT_HYBRID auto)
# at 16 and 32 slots a layer on each device, paired rounds, upstream in a worker; then gpt-oss-20b (24 layers, 32
# experts top-4, MXFP4 experts with biases, locality routing) on one device: the cache alone and the split at 4 / 8
# slots a layer (12.5 / 25%), upstream and every weight in VRAM in workers.
N_LAYER=16 MODEL=q16-loc SPARE_GIB=4 source docs/results/defaults-gpu-2026-12-07/common.sh
D=$OUT/Q; mkdir -p $D
cd_run() {  # NAME ARGS...: bench/cache_decode.py ARGS into $D/NAME
  local n=$1; shift; echo "== $n ($(left) s left)"; [ $(left) -lt 100 ] && return
  (cd /tmp && timeout $(( $(left) - 15 )) python3 $R/bench/cache_decode.py "$@" -n 128 --depth 2048 --rounds 4 \
     --budget $(( $(left) - 100 )) --out $D/$n) > $D/$n.txt 2>&1
  tail -9 $D/$n.txt | cut -c1-240
}
GGML_CUDA_DEVICES=2 CUDA_VISIBLE_DEVICES=0 cd_run split --model $M --devices cuda --sizes 0,-16,-32 --hybrid 0,auto
G=/tmp/pp_models/goss-loc.gguf
[ -f $G ] || pp synth $G --preset gpt-oss-20b --routing locality | tail -1
cd_run goss --model $G --devices cuda --sizes 0,-4,-8 --hybrid 0,auto --ceiling
echo "call: $(( $(date +%s) - t0 )) s"
