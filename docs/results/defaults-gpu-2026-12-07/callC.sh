#!/usr/bin/env bash
# Call C (device run, carry [".upstream", ".whl", ".cuda"]): prompts with the defaults on a 24-layer model of the
# 30B-A3B shape (locality routing; 16 GB, written in half the time of the full preset), ~6 GiB of the GPU for it:
# the patched build with -ub auto (fit weighs LAYER_MAJOR and the pair), the hand-set LAYER_MAJOR=1 / 0 rows, upstream
# with its own fit, and every weight in VRAM (the ceiling), pp16384 (and PP=... lengths).
set -o pipefail
R=$PWD; t0=$(date +%s); export PYTHONUNBUFFERED=1
left() { echo $(( ${CALL_S:-585} - ($(date +%s) - t0) )); }
if (cd /tmp && PYTHONPATH=/tmp/site python3 -c "import pyllama_pp.binding") 2>/dev/null; then echo "warm: build kept"
else PP_CALL_LIMIT=300 bash bench/gpu_run.sh --devices cuda:0 --skip correctness,synth,sweep 2>&1 | tail -2; fi
export PYTHONPATH=/tmp/site PYLLAMA_PP_CACHE=/tmp/pp_cache
printf '#!/bin/sh\ncd /tmp && exec python3 -c "import sys; from pyllama_pp.cli import main; sys.exit(main(sys.argv[1:]))" "$@"\n' > /tmp/pp
chmod +x /tmp/pp; M=/tmp/pp_models/q24-loc.gguf; mkdir -p /tmp/pp_models /tmp/C
[ -f $M ] || /tmp/pp synth $M --preset qwen3-30b-a3b --n-layer 24 --routing locality | tail -1
TOT=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); MARGIN=$(( TOT / 1024 - 6 ))GiB
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; echo "margin $MARGIN, $(left) s left"
row() {  # NAME ARGS...: one run, its table's last line
  local name=$1; shift; [ $(left) -lt 70 ] && { echo "== $name skipped: $(left) s left"; return; }
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - 25 )) /tmp/pp run $M --devices cuda:0 -n 0 -r 2 "$@" -o /tmp/C/$name > /tmp/C/$name.txt 2>&1
  grep -E "layer major|memory:|^patched|^baseline" /tmp/C/$name.txt | cut -c1-220 | tail -4
}
for p in ${PP:-16384}; do
  row default-pp$p   --fit --margin $MARGIN -p $p -ub auto
  row lm1-pp$p       --fit --margin $MARGIN -p $p -b $p -ub 4096 --switch LAYER_MAJOR=1
  row lm0-pp$p       --fit --margin $MARGIN -p $p -b $p -ub 8192 --switch LAYER_MAJOR=0
  row upstream-pp$p  --variant baseline --fit --margin $MARGIN -p $p -b $p -ub 8192
  row vram-pp$p      --variant baseline --host-experts none -p $p -b $p -ub 4096
done
tar czf $OUT/C.tgz -C /tmp C; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
