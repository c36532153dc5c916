#!/usr/bin/env bash
# Issue 6: build both variants with the shared CUDA module on the GPU machine (no registry there), then run
# bench/gpu_run.py. Carry: .upstream/upstream.tar.xz (fetch.py --write-trimmed) and .whl/ (cffi, pycparser).
#   device run, carry [".upstream", ".whl"]:  bash bench/gpu_run.sh [gpu_run.py args]
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
export PYLLAMA_PP_UPSTREAM_ARCHIVE=$PWD/.upstream/upstream.tar.xz PYLLAMA_PP_CACHE=/tmp/pp_cache
python3 -c "import sysconfig, os; p = sysconfig.get_paths()['include']; print('Python.h:', os.path.exists(p + '/Python.h'), p)"
if [ ! -f /tmp/pp_built ]; then
    CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" python3 -m pip install --no-build-isolation --no-index \
        --no-deps -v . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
    touch /tmp/pp_built
fi
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpus.csv"
cd /tmp && python3 "$OLDPWD/bench/gpu_run.py" --out "$OUT" "$@"
