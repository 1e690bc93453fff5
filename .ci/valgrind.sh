#!/usr/bin/env bash
# CI stage: tests/valgrind_smoke.py under valgrind memcheck, on the scalar and AVX2 paths.
#
#   bash .ci/valgrind.sh            # from anywhere inside the checkout
#
# valgrind cannot execute AVX-512 (its CPUID hides it, so LORA_ISA=avx512 would not even be
# chosen); .ci/sanitize.sh covers that path with ASan.  This stage adds what ASan does not
# check: reads of uninitialised memory (e.g. padding of the packed deltas, scratch).
#
# The extension is built normally (with -g, as setuptools adds) by `pip wheel` from a throwaway
# copy of the checkout, and the compiled module is put into that copy.  valgrind runs with --error-exitcode=97, PYTHONMALLOC=malloc (so Python objects are
# real heap blocks memcheck can see) and --leak-check=no (CPython keeps its interned objects
# until exit; the extension's one allocation pair, lora_delta_new/free, is owned by ffi.gc).
# XML mode lists leak records anyway; they are counted apart and not judged.
#
# Which errors count: CPython 3.11 itself raises a few known uninitialised-value reports at
# start-up (int.from_bytes in the import machinery) and ld.so one in strncmp, none of them ours.
# So every error is written as XML with --track-origins=yes, and an error counts as OURS when any
# frame of its stack, or of the stack where its uninitialised value was created, lies in the
# _lora_cffi extension.  The stage fails on any such error, on a smoke check failing, or on the
# requested ISA not being the one that ran; other errors are listed, not counted.
#
# Environment: PYTHON (default python3) with numpy, cffi, ml_dtypes, safetensors, gguf; a
# throwaway venv is made when it lacks them.  VALGRIND_KEEP=1 keeps the work directory.
# Takes about 3-4 minutes on 2 cores (the two runs side by side, ~3 min each).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
. "$ROOT/.ci/stage_lib.sh"
stage_begin valgrind VALGRIND_KEEP

command -v valgrind >/dev/null || fail "valgrind is not installed (apt-get install valgrind)"

copy_checkout
python_with numpy cffi ml_dtypes safetensors gguf

log "building the extension (no sanitizers)"
build_into_copy "" || { cat "$WORK/build.log"; fail "build"; }

status=0
summary=""
# The two paths run side by side, one valgrind process per core (memcheck runs a process's
# threads one at a time anyway): about half the stage's time.
isas=()
for isa in scalar avx2; do
    if ! (cd "$WORK/src" && PYTHONPATH="$WORK/src" "$PY" -c \
            "import lora, sys; sys.exit('$isa' not in lora.kernel_info()['available_isas'])"); then
        log "$isa is not available on this CPU/build: skipped"
        summary="$summary $isa=skipped"
        continue
    fi
    isas+=("$isa")
    log "memcheck, LORA_ISA=$isa (started)"
    (
        rc=0
        cd "$WORK/src" && PYTHONPATH="$WORK/src" PYTHONMALLOC=malloc LORA_ISA="$isa" \
            OMP_NUM_THREADS=2 \
            valgrind --tool=memcheck --error-exitcode=97 --leak-check=no --track-origins=yes \
                --num-callers=40 --xml=yes --xml-file="$WORK/memcheck-$isa.xml" \
                "$PY" tests/valgrind_smoke.py >"$WORK/smoke-$isa.log" 2>&1 || rc=$?
        echo "$rc" >"$WORK/rc-$isa"
    ) &
done
wait
for isa in "${isas[@]}"; do
    xml="$WORK/memcheck-$isa.xml"
    rc="$(cat "$WORK/rc-$isa")"
    # Judge the XML: errors with a frame in our extension count; the rest are listed.
    verdict="$("$PY" - "$xml" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
ours, other, leaks = [], {}, 0
for err in root.iter("error"):
    kind = err.findtext("kind")
    if kind.startswith("Leak_"):  # XML mode reports leaks even with --leak-check=no: not judged
        leaks += 1
        continue
    frames = [(f.findtext("fn") or "?", f.findtext("obj") or "?", f.findtext("file") or "",
               f.findtext("line") or "") for st in err.findall("stack") for f in st.iter("frame")]
    if any("_lora_cffi" in obj for _, obj, _, _ in frames):
        ours.append((kind, err.findtext("what") or err.findtext("xwhat/text") or "", frames))
    else:
        top = next(((fn, obj.rsplit("/", 1)[-1]) for fn, obj, _, _ in frames), ("?", "?"))
        other[(kind, top)] = other.get((kind, top), 0) + 1
for kind, what, frames in ours:
    print(f"OURS {kind}: {what}", file=sys.stderr)
    for fn, obj, file, line in frames[:25]:
        print(f"    {fn} ({file}:{line}) in {obj.rsplit('/', 1)[-1]}", file=sys.stderr)
for (kind, (fn, obj)), n in sorted(other.items()):
    print(f"  not ours: {n} x {kind} at {fn} in {obj}", file=sys.stderr)
if leaks:
    print(f"  not judged: {leaks} leak records at exit (CPython and cffi keep module state)",
          file=sys.stderr)
print(f"{len(ours)} {sum(other.values())}")
PYEOF
)"
    read -r n_ours n_other <<<"$verdict"
    log "LORA_ISA=$isa: smoke exit $rc; memcheck errors in lora: $n_ours; elsewhere (CPython, ld.so): $n_other"
    summary="$summary $isa=$n_ours"
    if [ "$n_ours" != 0 ]; then status=1; fi
    if [ "$rc" != 0 ] && [ "$rc" != 97 ]; then
        cat "$WORK/smoke-$isa.log"
        log "FAIL: the smoke script failed on $isa"
        status=1
    fi
done
log "errors from lora per path:$summary; status $status"
exit "$status"
