#!/usr/bin/env bash
# CI stage: the test suite (all but the PEFT / transformers model tests) against an ASan + UBSan
# build of the extension.
#
#   bash .ci/sanitize.sh            # from the repository root (or anywhere inside it)
#
# What it does, and why:
#  1. Copies the checkout (tracked + untracked-but-not-ignored files, no build outputs) into a
#     throwaway directory, so the developer's in-place build is never replaced by an
#     instrumented one.
#  2. Builds the extension from there with LORA_CFLAGS="-fsanitize=address,undefined
#     -fno-omit-frame-pointer" (_cffi_build.py adds LORA_CFLAGS to compile and link flags) through
#     `pip wheel`, so the project's own build requirements apply, puts the compiled module into
#     the copy, and checks that it really links the ASan runtime.
#  3. Runs `pytest -m "not model" tests` (the PEFT / transformers model tests run in the README
#     stage only) with the ASan runtime preloaded (CPython itself is not instrumented, so
#     libasan must be first in the process), PYTHONMALLOC=malloc (Python objects go through
#     ASan's allocator too), CI=1 (hypothesis' bounded CI profile) and LORA_UNDER_ASAN=1 (the few
#     tests that cannot run under ASan skip themselves with that reason; see tests/).
#  4. Runs tests/valgrind_smoke.py once per ISA path this CPU supports (LORA_ISA=scalar, avx2,
#     avx512): pytest exercises only the best path unless a test forces one, and the AVX-512
#     path is covered by nothing else (valgrind cannot execute it).
#
# Sanitizer settings:
#  - ASAN_OPTIONS detect_leaks=0: CPython never frees its interned objects and module state, so
#    LeakSanitizer would print thousands of "leaks" that are not ours.  The extension's own
#    ownership (lora_delta_new/free through ffi.gc) is simple enough to check by reading.
#  - allocator_may_return_null=1: a failed or absurd allocation returns NULL as it would in
#    production, so the library's own MemoryError paths run instead of ASan aborting.
#  - UBSAN_OPTIONS halt_on_error=1:print_stacktrace=1 (+ a SUMMARY line naming the kind), and
#    -fno-sanitize-recover=undefined, so the first undefined behaviour stops the process.
#  - ASan reports go to log files under the work directory (log_path), also from subprocesses
#    (fuzz workers, fork children) whose stderr a test might swallow.  GCC's UBSan, combined
#    with ASan, ignores log_path, so pytest runs with --capture=sys (a report that kills the
#    process stays visible) and the output is scanned for sanitizer SUMMARY lines, which also
#    end the tail of a child's stderr that a failing test prints.  Any report fails the stage.
#
# Environment: PYTHON (default: python3) must have numpy, cffi, ml_dtypes, safetensors, gguf,
# pytest and hypothesis; when it lacks any, a throwaway venv with them is created.  The build
# needs pip and a package index (or a cache) for pyproject.toml's build requirements.  CC (default
# gcc) must be able to -fsanitize=address,undefined.  SANITIZE_KEEP=1 keeps the work directory.
# Takes about 8-9 minutes on 2 quiet cores (2.5 of them the instrumented build).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
CC_BIN="${CC:-gcc}"
. "$ROOT/.ci/stage_lib.sh"
stage_begin sanitize SANITIZE_KEEP

# --- 1. a clean copy of the checkout ---------------------------------------------------------
mkdir -p "$WORK/src" "$WORK/logs" "$WORK/out"
copy_checkout

# --- 2. Python with the test dependencies ----------------------------------------------------
python_with_test_deps

# --- 3. the instrumented build ---------------------------------------------------------------
# -O1 (after the build's -O3): GCC took 228 s for kernels_avx512.c at -O3 with both
# sanitizers, about a third of that at -O1, the optimisation ASan's authors recommend; the
# kernels' bits do not depend on it (no fast-math, -ffp-contract=off, the orders written out)
SAN_FLAGS="-O1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g"
log "building with LORA_CFLAGS='$SAN_FLAGS'"
export CC="$CC_BIN"
build_into_copy "$SAN_FLAGS" || { cat "$WORK/build.log"; fail "instrumented build"; }
SO="$(ls "$WORK"/src/lora/_lora_cffi*.so)"
if ! ldd "$SO" | grep libasan >/dev/null; then
    ldd "$SO"; fail "$SO does not link libasan: LORA_CFLAGS did not reach the build"
fi
ASAN_RT="$("$CC_BIN" -print-file-name=libasan.so)"
[ -e "$ASAN_RT" ] || fail "no ASan runtime at '$ASAN_RT'"
# libstdc++ right after the ASan runtime: CPython is C, so otherwise ASan's __cxa_throw
# interceptor finds no real __cxa_throw and the first C++ exception torch throws (a
# RuntimeError in Python) aborts the process instead.
STDCXX="$("$CC_BIN" -print-file-name=libstdc++.so.6)"
PRELOAD="$ASAN_RT"
[ -e "$STDCXX" ] && PRELOAD="$ASAN_RT $STDCXX"

san_env=(
    env
    "LD_PRELOAD=$PRELOAD"
    "ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:abort_on_error=0:log_path=$WORK/logs/asan"
    "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:print_summary=1:report_error_type=1"
    "PYTHONMALLOC=malloc"
    "PYTHONPATH=$WORK/src"
    "PYTHONDONTWRITEBYTECODE=1"
    "LORA_UNDER_ASAN=1"
    "CI=1"
)

reports() { find "$WORK/logs" -type f | sort; }

# --- canary: the instrumentation must be alive, or "zero reports" means nothing ---------------
# lora_delta_export told to write a 4x8 delta into 4-float buffers: a heap-buffer-overflow inside
# the extension that ASan must report (the Python layer never makes such a call).
mkdir -p "$WORK/canary"
canary_env=("${san_env[@]}" "ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:log_path=$WORK/canary/asan")
(cd "$WORK/src" && "${canary_env[@]}" "$PY" -c '
import numpy as np, lora
from lora._lora_cffi import ffi, lib
d = lora.LoraDelta(np.ones((4, 8), np.float32), np.ones((8, 4), np.float32))
small = ffi.new("float[4]")
lib.lora_delta_export(d._ptr, small, small)
') >/dev/null 2>&1 && true
if ! grep -qs "heap-buffer-overflow" "$WORK"/canary/asan.*; then
    fail "the ASan canary was not reported: the sanitizer runtime is not active"
fi
log "canary: ASan reports a deliberate overflow in the extension (instrumentation is live)"

# --- 4. the test suite -----------------------------------------------------------------------
status=0
log "pytest tests (ASan+UBSan, $("${san_env[@]}" "$PY" -c 'import lora; print(lora.kernel_info()["isa"])' 2>/dev/null || echo '?'))"
# --capture=sys, not pytest's default fd capture: a sanitizer writes its report to file
# descriptor 2, and with fd capture a report that ends the process vanishes with it (checked:
# zero lines of output).  Python-level output is still captured per test.
(cd "$WORK/src" && "${san_env[@]}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    --capture=sys -m "not model" tests 2>&1 | tee "$WORK/out/pytest.log"; exit "${PIPESTATUS[0]}") \
    || { status=$?; log "pytest exited with status $status"; }

# --- 5. every ISA path through the smoke script ----------------------------------------------
isas="$(cd "$WORK/src" && "${san_env[@]}" "$PY" -c 'import lora; print(" ".join(lora.kernel_info()["available_isas"]))')"
for isa in $isas; do
    log "tests/valgrind_smoke.py with LORA_ISA=$isa"
    (cd "$WORK/src" && "${san_env[@]}" "LORA_ISA=$isa" "$PY" tests/valgrind_smoke.py 2>&1 \
        | tee "$WORK/out/smoke-$isa.log"; exit "${PIPESTATUS[0]}") \
        || { rc=$?; log "smoke on $isa exited with status $rc"; status=1; }
done

# --- 6. verdict ------------------------------------------------------------------------------
# ASan reports land in log files (log_path).  GCC's UBSan runtime, combined with ASan, ignores
# log_path and writes to stderr, so UBSan reports are counted in the captured output by their
# last line, "SUMMARY: UndefinedBehaviorSanitizer: <kind> <file:line>" -- the line a test that
# prints the tail of a child process's stderr in its failure message shows too.
n_files="$(reports | wc -l)"
# (pytest may print one child's report several times in a failure: distinct lines are counted)
# (grep finds nothing on a clean run and exits 1: under pipefail that must not end the script)
n_stderr="$(cat "$WORK"/out/*.log | { grep -o -E 'SUMMARY: (UndefinedBehavior|Address)Sanitizer: [^ ]+ [^ ]+' || true; } \
    | sort -u | wc -l)"
n_reports=$((n_files + n_stderr))
if [ "$n_reports" -gt 0 ]; then
    log "FAIL: $n_reports sanitizer report(s):"
    for f in $(reports); do echo "==== $f"; cat "$f"; done
    cat "$WORK"/out/*.log | grep -o -E 'SUMMARY: (UndefinedBehavior|Address)Sanitizer: [^ ]+ [^ ]+' \
        | sort | uniq -c || true
    status=1
elif [ "$status" != 0 ]; then
    log "no sanitizer report was seen, but a check failed (above); a report from a child process"
    log "shows only in that test's failure message"
fi
log "sanitizer reports: $n_reports; ISA paths smoke-tested: ${isas}; status $status"
exit "$status"
