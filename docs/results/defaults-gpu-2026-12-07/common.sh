# shared by the calls (sourced): the build where the machine is fresh, the 30B-A3B preset (or PRESET) with locality routing (ROUTING)
# (N_LAYER of its layers, default all 48; MODEL its file's name), a margin that leaves SPARE_GIB of the GPU to the
# model (default 10: about a quarter of the 48 layers' experts fit), helpers
set -o pipefail
R=$PWD; t0=$(date +%s); export PYTHONUNBUFFERED=1
left() { echo $(( ${CALL_S:-585} - ($(date +%s) - t0) )); }
if (cd /tmp && PYTHONPATH=/tmp/site python3 -c "import pyllama_pp.binding") 2>/dev/null; then echo "warm: build kept"
else PP_CALL_LIMIT=400 bash bench/gpu_run.sh --devices cuda:0 --skip correctness,synth,sweep 2>&1 | tail -4; fi
export PYTHONPATH=/tmp/site PYLLAMA_PP_CACHE=/tmp/pp_cache
printf '#!/bin/sh\ncd /tmp && exec python3 -c "import sys; from pyllama_pp.cli import main; sys.exit(main(sys.argv[1:]))" "$@"\n' > /tmp/pp
chmod +x /tmp/pp; pp() { /tmp/pp "$@"; }
M=/tmp/pp_models/${MODEL:-q30-loc}.gguf; mkdir -p /tmp/pp_models /tmp/A
[ -f $M ] || { pp synth $M --preset ${PRESET:-qwen3-30b-a3b} --n-layer ${N_LAYER:-48} --routing ${ROUTING:-locality} | tail -1
               echo "synth: $(( $(date +%s) - t0 )) s"; }
TOT=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MARGIN=$(( TOT / 1024 - ${SPARE_GIB:-10} ))GiB
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
echo "margin $MARGIN, $(left) s left"
one() {  # NAME ARGS...: one pyllama-pp command (run, ab, fit) into $D/NAME, and its lines that match $SHOW
  local name=$1; shift; [[ -n ${ONLY:-} && ! $name =~ $ONLY ]] && return  # ONLY=REGEX: the rows to run
  [ $(left) -lt ${MIN_LEFT:-60} ] && { echo "== $name skipped: $(left) s left"; return; }
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - 20 )) /tmp/pp "$@" -o $D/$name > $D/$name.txt 2>&1
  grep -E "$SHOW" $D/$name.txt | cut -c1-260 | tail -8
}
