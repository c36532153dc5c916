#!/usr/bin/env bash
# Build both variants with the shared CUDA module on the GPU machine (no registry there), then run
# bench/gpu_run.py. Carry: .upstream/upstream.tar.xz (fetch.py --write-trimmed) and .whl/ (cffi, pycparser, gguf, pyyaml).
#   device run, carry [".upstream", ".whl"]:  bash bench/gpu_run.sh [gpu_run.py args]
#   its arguments: python bench/gpu_run.py --help; PP_* variables: the comments below
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
export PYLLAMA_PP_UPSTREAM_ARCHIVE=$PWD/.upstream/upstream.tar.xz PYLLAMA_PP_CACHE=/tmp/pp_cache
python3 -c "import sysconfig, os; p = sysconfig.get_paths()['include']; print('Python.h:', os.path.exists(p + '/Python.h'), p)"
# The CUDA module is built from the pristine tree and shared by both variants, so a module built by an
# earlier call (returned as $OUT/cuda.xz.part*, carried back as .cuda/) is reused: the call then builds only
# the two variants' CPU-side libraries (~1 min instead of ~3-4).
# (pyllama_pp's CUDA gather library, GATHER, is built either way: with the module, or alone - one small file)
CUDA_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"; CARRIED=0
if ls .cuda/cuda.xz.part* > /dev/null 2>&1; then
    CUDA_ARGS="-DPP_CUDA_GATHER=ON -DCMAKE_CUDA_ARCHITECTURES=90"; CARRIED=1; echo "reusing the carried CUDA module"
fi
CMAKE_ARGS="$CUDA_ARGS" python3 -m pip install --no-build-isolation --no-index --no-deps -v . > /tmp/build.log 2>&1 \
    || { tail -50 /tmp/build.log; exit 1; }
B=$(cd /tmp && python3 -c "import pyllama_pp.binding as b; print(b.BACKENDS_DIR)")
if [ $CARRIED = 1 ]; then
    cat .cuda/cuda.xz.part* | xz -d > "$B/libggml-cuda.so"
else
    xz -T0 -6 -c "$B/libggml-cuda.so" | split -b 15M - "$OUT/cuda.xz.part"
fi
ls -la "$B" "$OUT"
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee /tmp/gpus.csv
if [ "${1:-}" = "debug2" ]; then
    set +e
    V=$(python3 -c "import pyllama_pp.binding as b; print(b.VARIANTS_DIR)"); B=$(python3 -c "import pyllama_pp.binding as b; print(b.BACKENDS_DIR)")
    { echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; cat /etc/ld.so.conf.d/* 2>/dev/null; ls /opt/gcc/lib64 2>/dev/null | head -20
      for f in $V/baseline/libllama.so $V/baseline/libggml.so $V/baseline/libpyllama_pp_shim.so $B/libggml-cuda.so $B/libggml-cpu.so; do
        echo "== $f"; ldd $f | grep -E "stdc|gcc_s|cuda|not found"; readelf -d $f | grep -E "RUNPATH|RPATH"; nm -D --defined-only $f | grep -c " _ZNSo"; done
      strings /lib/x86_64-linux-gnu/libstdc++.so.6 | grep -E "^GLIBCXX_3\.4\.3" | tail -2; } > "$OUT/env.txt" 2>&1
    cat "$OUT/env.txt" | head -60
    cd /tmp && python3 -c "from pyllama_pp import synth; synth.write_gguf('/tmp/tiny.gguf', synth.preset('tiny', seed=1, n_layer=7))"
    echo '{"variant": "baseline", "kind": "logits", "model": "/tmp/tiny.gguf", "devices": "cuda", "placement": {"host_experts": "all"}, "ctx": {"n_ctx": 256, "n_batch": 64, "n_ubatch": 64}, "n_tokens": 64, "out": "/tmp/l.npy"}' > /tmp/job.json
    for pre in "" "/opt/gcc/lib64/libstdc++.so.6"; do
        LD_PRELOAD=$pre timeout 120 python3 -m pyllama_pp.worker < /tmp/job.json > /tmp/r.txt 2>&1; echo "preload=[$pre] rc=$?"; tail -c 300 /tmp/r.txt; echo
    done
    mv $B/libggml-cuda.so /tmp/; sed -i 's/"cuda"/"cpu"/' /tmp/job.json
    timeout 120 python3 -m pyllama_pp.worker < /tmp/job.json > /tmp/r.txt 2>&1; echo "no cuda module, cpu: rc=$?"; tail -c 300 /tmp/r.txt
    mv /tmp/libggml-cuda.so $B/
    exit 0
fi
if [ "${1:-}" = "debug" ]; then
    set +e
    # native backtraces of a worker on the tiny preset (cuda-gdb also debugs host code)
    cd /tmp && python3 -c "from pyllama_pp import synth; synth.write_gguf('/tmp/tiny.gguf', synth.preset('tiny', seed=1, n_layer=7))"
    for he in none; do
        for dev in cpu cuda:0 cuda; do
            echo "{\"variant\": \"baseline\", \"kind\": \"logits\", \"model\": \"/tmp/tiny.gguf\", \"devices\": \"$dev\", \"placement\": {\"host_experts\": \"$he\"}, \"ctx\": {\"n_ctx\": 256, \"n_batch\": 64, \"n_ubatch\": 64}, \"n_tokens\": 64, \"out\": \"/tmp/l.npy\"}" > /tmp/job.json
            log="$OUT/debug_${he}_${dev/:/_}.log"
            PYLLAMA_PP_LOG=3 timeout 120 python3 -X faulthandler -m pyllama_pp.worker < /tmp/job.json > "$log" 2>&1; echo "rc=$? he=$he dev=$dev" | tee -a "$log"
            if ! grep -q '"shape"' "$log"; then
                timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -m pyllama_pp.worker < /tmp/job.json >> "$log" 2>&1 || true
            fi
            tail -5 "$log"
        done
    done
    exit 0
fi
# results go to one archive: at most 8 files come back from $OUT
rm -rf /tmp/res; mkdir -p /tmp/res; cp /tmp/build.log /tmp/gpus.csv /tmp/res/   # a warm machine keeps /tmp
echo "build: $(( $(date +%s) - t0 )) s (including the carried wheels' install), $(date -u '+%Y-%m-%d %H:%M:%S UTC')" > /tmp/res/build_time.txt
set +e
if [ "${PP_PROBE:-0}" = 1 ]; then  # CUDA launch-queue depth and one-thread pinned copies to two GPUs
    (cd /tmp && timeout 90 python3 "$OLDPWD/lab/cuda_queue.py" --out /tmp/res) 2>&1 | tail -20
fi
if [ "${PP_GATHER_PROBE:-0}" = 1 ]; then  # the CUDA gather's kernels beside compute, no model (lab/gather_probe.cu)
    NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    "$NVCC" -O3 -arch=sm_90 -std=c++17 -I pyllama_pp/native lab/gather_probe.cu -o /tmp/gather_probe \
        && timeout 120 /tmp/gather_probe 2>&1 | tee /tmp/res/gather_probe.txt
fi
if [ "${PP_Q6:-0}" = 1 ]; then  # re-reservations in a mixed workload (bench/q6_reservation.py on the GPUs, 30B model)
    M=/tmp/pp_models/qwen3-30b-a3b-uniform.gguf   # written by gpu_run.py's synth step (the sweeps' model)
    (cd /tmp && python3 "$OLDPWD/bench/gpu_run.py" --out /tmp/res/q6 --skip correctness,sweep --budget 90) | tail -2
    # PP_Q6_REPEAT=N runs it N times, the variants' order alternating (q6, q6-2, ...); PP_Q6_LOGITS=1 also compares
    # every step's logits; PP_Q6_ENV_LAST="GGML_SCHED_PP_X=V ..." sets switches for the last repetition only
    # (each repetition stops at what is left of the call, so the results archive below is always written)
    n=${PP_Q6_REPEAT:-1}
    for i in $(seq 1 $n); do
        left=$(( ${PP_CALL_LIMIT:-570} - ($(date +%s) - t0) - 30 ))
        if [ $left -lt 60 ]; then echo "q6 repetition $i skipped: ${left} s left"; break; fi
        order=baseline,patched; [ $((i % 2)) = 0 ] && order=patched,baseline
        d=/tmp/res/q6; [ $i -gt 1 ] && d=/tmp/res/q6-$i
        envs=(); [ $i = $n ] && read -ra envs <<< "${PP_Q6_ENV_LAST:-}"
        (cd /tmp && env ${envs[@]+"${envs[@]}"} timeout $(( left < 200 ? left : 200 )) python3 "$OLDPWD/bench/q6_reservation.py" \
            --devices cuda --model "$M" --out $d --reps 2 --rounds ${PP_Q6_ROUNDS:-2} --n-batch 4096 --n-ubatch 512 \
            --order $order $([ "${PP_Q6_LOGITS:-0}" = 1 ] && echo --logits)) 2>&1 | tail -${PP_Q6_TAIL:-30}
    done
fi
if [ -n "${PP_SOAK:-}" ]; then  # the soak (bench/soak.py: tiny preset, every expert in host RAM) on CUDA
    # PP_SOAK holds its arguments, e.g. "--calls 300 --variant both" (--devices cuda: the first two CUDA devices;
    # GGML_CUDA_DEVICES=2 CUDA_VISIBLE_DEVICES=0: one GPU as two); JSON and tables in soak/ of the archive, output
    # in soak.log
    left=$(( ${PP_CALL_LIMIT:-570} - ($(date +%s) - t0) - 30 ))
    (cd /tmp && timeout $left python3 "$OLDPWD/bench/soak.py" --devices cuda $PP_SOAK --out /tmp/res/soak) 2>&1 \
        | tee /tmp/res/soak.log | tail -${PP_SOAK_TAIL:-40}
fi
# the script's budget: what is left of the call (PP_CALL_LIMIT, default 570 s of the 600 s a call may run)
budget=$(( ${PP_CALL_LIMIT:-570} - ($(date +%s) - t0) ))
# another bench script instead of gpu_run.py, e.g. PP_ONLY=bench/fit_gpu.py (its results in a folder of its name)
script=${PP_ONLY:-bench/gpu_run.py}; [ "${script#/}" = "$script" ] && script=$PWD/$script; res=/tmp/res
[ -n "${PP_ONLY:-}" ] && res=/tmp/res/$(basename "$PP_ONLY" .py)
cd /tmp && python3 "$script" --out "$res" --budget $budget "$@" 2>&1 | tee /tmp/res/run.log; rc=${PIPESTATUS[0]}
tar czf "$OUT/results.tgz" -C /tmp/res . && ls -la "$OUT"
exit $rc
