#!/usr/bin/env bash
# CI stage: the extension built with clang instead of gcc, with and without OpenMP.
#
#   bash .ci/clang.sh            # from anywhere inside the checkout
#
# 1. clang -Wall -Wextra -Werror -fsyntax-only over csrc/ (x86-64; the aarch64 NEON file is
#    compiled with clang by .ci/neon.sh).
# 2. An OpenMP build (CC=clang, OpenMP from LLVM's libomp: Debian's libomp-dev, installed here
#    if missing; if it cannot be installed the build falls back to serial and this stage says
#    so), through `pip wheel` from a copy of the checkout; kernel_info() must name clang and,
#    with libomp, report openmp; then a subset of the tests: test_golden_bits.py (the bits
#    themselves: gcc's and clang's builds must agree on every path), test_guarantees.py (bits across
#    runs, threads and batch sizes, stacks, every ISA path), test_bank.py, test_half.py,
#    test_threads.py.  The whole suite runs on the gcc build in .ci/run.
# 3. A serial build (CC=clang LORA_DISABLE_OPENMP=1): openmp must be False, threads 1, and
#    test_guarantees.py passes.
#
# Environment: PYTHON (default python3) with the test dependencies, or a throwaway venv is made.
# CLANG_KEEP=1 keeps the work directory.  Takes about 1-2 minutes on 2 cores (two builds, ~20 s
# each; the subset ~25 s).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
. "$ROOT/.ci/stage_lib.sh"
stage_begin clang CLANG_KEEP

if ! command -v clang >/dev/null; then
    log "installing clang"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null
fi
omp_note="OpenMP from libomp"
if ! echo '#include <omp.h>
int main(void){return omp_get_max_threads() < 1;}' | clang -fopenmp -x c - -o "$WORK/omp_probe" 2>/dev/null; then
    log "clang cannot link OpenMP; installing libomp-dev"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libomp-dev >/dev/null; }; then
        omp_note="serial: libomp-dev could not be installed"
        log "$omp_note"
    fi
fi
log "$(clang --version | head -1); $omp_note"

python_with_test_deps
copy_checkout
cd "$WORK/src"

log "clang -Wall -Wextra -Werror -fsyntax-only csrc/*.c (with and without -fopenmp)"
if [ "$omp_note" = "OpenMP from libomp" ]; then
    clang -fsyntax-only -std=gnu11 -Wall -Wextra -Werror -Wno-unused-parameter -fopenmp -Icsrc csrc/*.c \
        || fail "clang warnings"
fi
clang -fsyntax-only -std=gnu11 -Wall -Wextra -Werror -Wno-unused-parameter -Icsrc csrc/*.c \
    || fail "clang warnings (serial)"
log "clang -Wall -Wextra -Werror -fsyntax-only csrc/python/edge.c (lora._edge)"
clang -fsyntax-only -std=gnu11 -Wall -Wextra -Werror -Wno-unused-parameter -Icsrc \
    -I"$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    -I"$("$PY" -c 'import numpy; print(numpy.get_include())')" csrc/python/edge.c \
    || fail "clang warnings (lora._edge)"

info() { (cd "$WORK/src" && PYTHONPATH="$WORK/src" "$PY" -c \
    'import lora; i = lora.kernel_info(); print(i["compiler"].split()[0], i["openmp"], i["threads"], i["isa"])'); }
run_tests() { (cd "$WORK/src" && PYTHONPATH="$WORK/src" CI=1 "$PY" -m pytest -q -p no:cacheprovider \
    -o addopts="-ra" "$@"); }

log "CC=clang build (OpenMP if it links)"
export CC=clang
build_into_copy "" || { cat "$WORK/build.log"; fail "clang build"; }
read -r compiler omp threads isa <<<"$(info)"
log "kernel_info: compiler=$compiler openmp=$omp threads=$threads isa=$isa"
[ "$compiler" = clang ] || fail "the extension was not built by clang"
if [ "$omp_note" = "OpenMP from libomp" ] && [ "$omp" != True ]; then fail "clang with libomp built serial"; fi
run_tests tests/test_golden_bits.py tests/test_guarantees.py tests/test_bank.py tests/test_half.py \
    tests/test_threads.py || fail "tests on the clang build"

log "CC=clang LORA_DISABLE_OPENMP=1 build"
# setuptools would reuse the objects of the first build (same sources, newer timestamps)
rm -rf "$WORK"/src/lora/_lora_cffi*.so "$WORK"/src/lora/_edge*.so "$WORK"/src/build
LORA_DISABLE_OPENMP=1 build_into_copy "" || { cat "$WORK/build.log"; fail "clang serial build"; }
read -r compiler omp threads isa <<<"$(info)"
log "kernel_info: compiler=$compiler openmp=$omp threads=$threads isa=$isa"
[ "$compiler" = clang ] && [ "$omp" = False ] && [ "$threads" = 1 ] || fail "expected a serial clang build"
run_tests tests/test_guarantees.py || fail "tests on the serial clang build"
log "ok ($omp_note)"
