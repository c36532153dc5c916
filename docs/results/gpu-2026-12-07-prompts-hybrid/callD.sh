#!/usr/bin/env bash
# Call D (device run, carry [".upstream", ".whl", ".cuda"]): on a 16-layer model of the 30B-A3B shape with locality
# routing (the preset's layers, fewer of them: written fast), every expert in pinned host RAM unless said:
#  1. prompts pp16384 / n_batch 16384: LAYER_MAJOR=1 at ub4096 (the lead-in fix) against every weight in VRAM;
#  2. decode tg128 @ d2048: the cache alone and the hybrid (EXPERT_HYBRID auto) at 16 and 32 slots, the CPU path,
#     upstream (bench/cache_decode.py: paired rounds);
#  3. the defaults: `run --fit --margin (GPU - 4 GiB) -ub auto` (fit weighs LAYER_MAJOR and the pair) and upstream
#     with its own fit at the same margin.
set -o pipefail
R=$PWD; t0=$(date +%s); export PYTHONUNBUFFERED=1
left() { echo $(( ${CALL_S:-585} - ($(date +%s) - t0) )); }
if (cd /tmp && PYTHONPATH=/tmp/site python3 -c "import pyllama_pp.binding") 2>/dev/null; then echo "warm: build kept"
else PP_CALL_LIMIT=300 bash bench/gpu_run.sh --devices cuda:0 --skip correctness,synth,sweep 2>&1 | grep -E "^build" ; fi
export PYTHONPATH=/tmp/site PYLLAMA_PP_CACHE=/tmp/pp_cache
printf '#!/bin/sh\ncd /tmp && exec python3 -c "import sys; from pyllama_pp.cli import main; sys.exit(main(sys.argv[1:]))" "$@"\n' > /tmp/pp
chmod +x /tmp/pp; M=/tmp/pp_models/q16-loc.gguf; mkdir -p /tmp/pp_models /tmp/D
[ -f $M ] || /tmp/pp synth $M --preset qwen3-30b-a3b --n-layer 16 --routing locality | tail -1
TOT=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); MARGIN=$(( TOT / 1024 - 4 ))GiB
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; echo "margin $MARGIN, $(left) s left"
row() {  # NAME ARGS...: one run, its table's last line
  local name=$1; shift; [ $(left) -lt 60 ] && { echo "== $name skipped: $(left) s left"; return; }
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - 20 )) /tmp/pp run $M --devices cuda:0 "$@" -o /tmp/D/$name > /tmp/D/$name.txt 2>&1
  grep -E "layer major|LAYER_MAJOR|memory:|^patched|^baseline|rror" /tmp/D/$name.txt | cut -c1-200 | tail -4
}
row lm1-pp16384   -p 16384 -n 0 -r 3 -b 16384 -ub 4096 --switch LAYER_MAJOR=1
row vram-pp16384  --variant baseline --host-experts none -p 16384 -n 0 -r 3 -b 16384 -ub 4096
echo "== hybrid ($(left) s left)"
(cd /tmp && timeout $(( $(left) - 150 )) python3 $R/bench/cache_decode.py --model $M --devices cuda --sizes 0,-16,-32 \
   --hybrid 0,auto -n 128 --depth 2048 --rounds 4 --budget $(( $(left) - 190 )) --out /tmp/D/hybrid) > /tmp/D/hybrid.txt 2>&1
tail -22 /tmp/D/hybrid.txt | cut -c1-240
row default-pp16384   --fit --margin $MARGIN -p 16384 -n 0 -r 2 -ub auto
row upstream-pp16384  --variant baseline --fit --margin $MARGIN -p 16384 -n 0 -r 2 -b 16384 -ub 8192
tar czf $OUT/D.tgz -C /tmp D; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
