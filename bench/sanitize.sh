#!/usr/bin/env bash
# Both variants built with sanitizers (the llama.cpp trees, the shim and VDEV), then the correctness tests and a
# fuzz run of switch combinations under them. A sanitizer report ends the worker with an error, so the test that
# ran it fails and pytest prints the report (the worker's stderr).
#
#   bash bench/sanitize.sh                    # ASan + UBSan
#   bash bench/sanitize.sh thread             # TSan: the VDEV async path with pipelining, OVERLAP and PREFETCH
#   PP_SAN_FUZZ=200 bash bench/sanitize.sh    # more fuzz cases (default 60)
#
# The build goes to build/san-<kind> (the normal build tree is left alone) and installs into a venv of its own.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
san=${1:-address,undefined}
tag=$(echo "$san" | tr ',' '-')
# PP_SAN_PYTHON: install into that interpreter instead of a venv of its own (the GPU machine's python3)
if [ -n "${PP_SAN_PYTHON:-}" ]; then
    py=$PP_SAN_PYTHON
else
    venv=/tmp/pp-san-$tag
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    py=$venv/bin/python
fi
rt() {   # the sanitizer runtime gcc links against (a bare name back means this gcc has none)
    local f; f=$(gcc -print-file-name="$1")
    [ -f "$f" ] || { echo "sanitize: gcc has no $1 (install its sanitizer runtime, e.g. libasan8 / libtsan2)" >&2; exit 2; }
    echo "$f"
}
if [ "$san" = thread ]; then preload=$(rt libtsan.so); else preload=$(rt libasan.so):$(rt libubsan.so); fi
t0=$(date +%s)
CMAKE_ARGS="-DPP_SANITIZE=$san ${CMAKE_ARGS:-}" "$py" -m pip install -q ${PP_SAN_PIP_ARGS:-} \
    -C build-dir="build/san-$tag" ".[test]"
echo "sanitize: $san build $(( $(date +%s) - t0 )) s"

export LD_PRELOAD=$preload
if [ "$san" = thread ]; then
    export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 report_signal_unsafe=0"
    tests=(tests/test_vdev.py tests/test_patched.py -k "overlap or prefetch or pipelin or early or gather")
else
    # Python itself is not instrumented: its allocations are not leaks of ours
    export ASAN_OPTIONS="detect_leaks=0 abort_on_error=1 halt_on_error=1"
    export UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1"
    tests=(tests/test_patched.py tests/test_vdev.py tests/test_variants.py tests/test_schedule.py tests/test_expert_hybrid.py)
fi
t0=$(date +%s)
status=0
(cd /tmp && "$py" -m pytest -q -p no:cacheprovider --rootdir="$OLDPWD" "${tests[@]/#tests/$OLDPWD/tests}") || status=$?
echo "sanitize: $san tests $(( $(date +%s) - t0 )) s, exit $status"
t0=$(date +%s)
(cd /tmp && PP_FUZZ_CASES=${PP_SAN_FUZZ:-60} PP_FUZZ_SEED=${PP_SAN_SEED:-50} \
    "$py" -m pytest -q -p no:cacheprovider --rootdir="$OLDPWD" "$OLDPWD/tests/test_fuzz.py") || status=$?
echo "sanitize: $san fuzz $(( $(date +%s) - t0 )) s, exit $status"
exit $status
