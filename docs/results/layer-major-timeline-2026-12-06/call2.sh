#!/usr/bin/env bash
# Call 2, only if call 1 ran out of time (device run on the machine call 1 left warm; carry [".upstream", ".whl",
# ".cuda"] in case it is fresh):
# a timeline call 1 did not finish, then the rows of sweeps.toml (bench/gpu_run.py) within the call.
set -o pipefail
R=$PWD; t0=$(date +%s); D=docs/results/layer-major-timeline-2026-12-06
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
M=/tmp/pp_models/qwen3-30b-a3b-uniform.gguf
if (cd /tmp && python3 -c "import pyllama_pp.binding") 2>/dev/null && [ -f $M ]; then echo "warm: build and model kept"
else echo "fresh machine: building"; mkdir -p /tmp/tl
  PP_CALL_LIMIT=500 bash bench/gpu_run.sh --devices cuda:0 --skip correctness,sweep --sweep prompt-best 2>&1 | tee /tmp/tl/build2.log | tail -8
fi
export PYTHONPATH=/tmp/site PYLLAMA_PP_CACHE=/tmp/pp_cache; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/tl /tmp/res2; cd /tmp
for spec in "lm_host|GGML_SCHED_PP_LAYER_MAJOR=1|" "vram_base|GGML_SCHED_PP_LAYER_MAJOR=0|--variant baseline --host-experts none"; do
  IFS='|' read -r name ev extra <<< "$spec"
  [ -f /tmp/tl/$name/timeline.json ] && continue
  echo "== timeline $name again"
  env $ev timeout 170 python3 $R/bench/timeline.py --model $M --devices cuda:0 -p 16384 -ub 4096 $extra --out /tmp/tl/$name 2>&1 | tail -10
  timeout 60 python3 $R/lab/timeline_edges.py /tmp/tl/$name/trace.json.gz --out /tmp/tl/$name --compact 2>&1 | tail -12
  x=""; [ $(stat -c %s /tmp/tl/$name/trace.json.gz 2>/dev/null || echo 0) -gt 13000000 ] && x="--exclude=trace.json.gz"
  tar cf $OUT/tl_$name.tar -C /tmp/tl $x $name
done
budget=$(( 575 - ($(date +%s) - t0) ))
python3 $R/bench/gpu_run.py --out /tmp/res2 --budget $budget --devices cuda:0 --skip correctness \
    --sweeps-file $R/$D/sweeps.toml --sweep lm-rows 2>&1 | tee /tmp/res2/run.log | grep -v "^\s*$" | tail -60
tar czf $OUT/rows.tgz -C /tmp/res2 .; ls -la $OUT; echo "call: $(( $(date +%s) - t0 )) s"
