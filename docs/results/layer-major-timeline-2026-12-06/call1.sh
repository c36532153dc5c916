#!/usr/bin/env bash
# Call 1 (device run, carry [".upstream", ".whl"]): build both variants with CUDA, write the 30B-A3B preset
# (near-uniform routing) to /tmp/pp_models, then three stream timelines of one pp16384 / ub4096 (n_batch 16384),
# then the rows of sweeps.toml in the time left.
set -o pipefail
R=$PWD; t0=$(date +%s)
mkdir -p /tmp/tl; PP_CALL_LIMIT=500 bash bench/gpu_run.sh --devices cuda:0 --skip correctness,sweep --sweep prompt-best 2>&1 | tee /tmp/tl/build.log | tail -25
export PYTHONPATH=/tmp/site PYLLAMA_PP_CACHE=/tmp/pp_cache PYTHONUNBUFFERED=1
M=/tmp/pp_models/qwen3-30b-a3b-uniform.gguf; ls -la $M; nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
mkdir -p /tmp/tl; cd /tmp
# the expert cache's guard from costs: fit measures the host CPU's expert op and each link where it plans the cache
# (4 GiB a device, reserved before placing; the margin keeps most experts in host RAM): the plan's break-even
timeout 150 python3 -c "import sys; from pyllama_pp.cli import main; sys.exit(main(sys.argv[1:]))" fit $M \
    --devices cuda:0 --margin 60GiB --expert-cache 4096MiB -c 4096 -b 2048 -ub 512 --json > $OUT/guard.json \
    2> /tmp/tl/guard.err; tail -3 /tmp/tl/guard.err
python3 -c "import json; d = json.load(open('$OUT/guard.json')); print('guard', d.get('cache_guard'), d.get('cpu_expert_gbps'), [x.get('link') for x in d['devices']], d['switches'])" || true
tl() {  # NAME [VAR=VALUE...]; timeline.py's extra arguments in TLARGS
  local name=$1; shift; local left=$(( ${CALL_S:-585} - ($(date +%s) - t0) ))
  if [ $left -lt 70 ]; then echo "== $name skipped: $left s left"; return; fi
  echo "== $name ($left s left) $(date -u '+%H:%M:%S UTC')"
  local lim=$(( left - 35 < 170 ? left - 35 : 170 ))
  env GGML_SCHED_PP_LAYER_MAJOR=0 "$@" timeout $lim python3 $R/bench/timeline.py --model $M --devices cuda:0 -p 16384 -ub 4096 "${TLARGS[@]}" --out /tmp/tl/$name 2>&1 | tee /tmp/tl/$name.log | grep -v "^\s*$" | tail -12
  timeout 90 python3 $R/lab/timeline_edges.py /tmp/tl/$name/trace.json.gz --out /tmp/tl/$name --compact 2>&1 | tee -a /tmp/tl/$name.log
  ls -la /tmp/tl/$name
}
TLARGS=();                                       tl lm_host   GGML_SCHED_PP_LAYER_MAJOR=1
TLARGS=(--variant baseline --host-experts none); tl vram_base
TLARGS=(--host-experts none);                    tl lm_vram   GGML_SCHED_PP_LAYER_MAJOR=1
cp /tmp/gpus.csv /tmp/tl/; cd /tmp/tl
for d in lm_host vram_base lm_vram; do   # one archive each (at most 8 files come back); a trace over 15 MB stays
  [ -d $d ] || continue; x=""; [ $(stat -c %s $d/trace.json.gz 2>/dev/null || echo 0) -gt 13000000 ] && x="--exclude=trace.json.gz"
  tar cf $OUT/tl_$d.tar $x $d $d.log; done
budget=$(( ${CALL_S:-585} - 25 - ($(date +%s) - t0) )); mkdir -p /tmp/res2; cd /tmp
if [ $budget -gt 60 ]; then   # the rows, as long as the call lasts (a block starts only where its est is left)
  python3 $R/bench/gpu_run.py --out /tmp/res2 --budget $budget --devices cuda:0 --skip correctness \
    --sweeps-file $R/docs/results/layer-major-timeline-2026-12-06/sweeps.toml --sweep lm-rows 2>&1 | tee /tmp/res2/run.log | grep -v "^\s*$" | tail -40
fi
cp -r /tmp/res /tmp/res2/build && rm -f $OUT/results.tgz; tar czf $OUT/rows.tgz -C /tmp/res2 .   # (at most 8 files)
ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
