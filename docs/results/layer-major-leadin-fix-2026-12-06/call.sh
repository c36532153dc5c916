#!/usr/bin/env bash
# One device call (kind nvidia-h100-x1 or nvidia-h200; carry [".upstream", ".whl"], and ".cuda" once you have it):
# build both variants with CUDA, write the 30B-A3B preset (near-uniform routing), then the stream timeline of one
# pp16384 / ub4096 LAYER_MAJOR=1 prompt with every expert in pinned host RAM (its "before the first kernel" was
# 0.368 s before this fix, 0.051 s in VRAM), then the rows of sweeps.toml in the time left.
#   bash docs/results/layer-major-leadin-fix-2026-12-06/call.sh      (CALL_S=N: the call's seconds, default 585)
set -o pipefail
R=$PWD; t0=$(date +%s); D=$R/docs/results/layer-major-leadin-fix-2026-12-06
mkdir -p /tmp/tl; PP_CALL_LIMIT=500 bash bench/gpu_run.sh --devices cuda:0 --skip correctness,sweep --sweep lm-fix \
    --sweeps-file $D/sweeps.toml 2>&1 | tee /tmp/tl/build.log | tail -25
export PYTHONPATH=/tmp/site PYLLAMA_PP_CACHE=/tmp/pp_cache PYTHONUNBUFFERED=1
M=/tmp/pp_models/qwen3-30b-a3b-uniform.gguf; ls -la $M; nvidia-smi --query-gpu=name,memory.total --format=csv
cd /tmp; left=$(( ${CALL_S:-585} - ($(date +%s) - t0) ))
if [ $left -gt 120 ]; then
  GGML_SCHED_PP_LAYER_MAJOR=1 timeout 170 python3 $R/bench/timeline.py --model $M --devices cuda:0 -p 16384 -ub 4096 \
      --out /tmp/tl/lm_host 2>&1 | tee /tmp/tl/lm_host.log | grep -v "^\s*$" | tail -12
  timeout 90 python3 $R/lab/timeline_edges.py /tmp/tl/lm_host/trace.json.gz --out /tmp/tl/lm_host --compact 2>&1 | tee -a /tmp/tl/lm_host.log
  tar cf $OUT/tl_lm_host.tar --exclude=trace.json.gz -C /tmp/tl lm_host lm_host.log
fi
budget=$(( ${CALL_S:-585} - 25 - ($(date +%s) - t0) )); mkdir -p /tmp/res2
if [ $budget -gt 60 ]; then
  python3 $R/bench/gpu_run.py --out /tmp/res2 --budget $budget --devices cuda:0 --skip correctness \
    --sweeps-file $D/sweeps.toml --sweep lm-fix 2>&1 | tee /tmp/res2/run.log | grep -v "^\s*$" | tail -40
fi
rm -f $OUT/results.tgz; tar czf $OUT/rows.tgz -C /tmp/res2 .; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
