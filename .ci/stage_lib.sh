# Shared by the .ci/*.sh stages.  Each stage script sets ROOT (the checkout) and PY (the Python to
# build and test with), sources this file and calls stage_begin with its name.

# A clean copy of the checkout in $WORK/src (tracked + untracked-but-not-ignored files, no build
# outputs), so the developer's in-place build is never replaced by an instrumented one.
copy_checkout() {
    mkdir -p "$WORK/src"
    if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
        (cd "$ROOT" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$WORK/src"
    else
        (cd "$ROOT" && tar --exclude=build --exclude='*.so' --exclude='.venv*' -cf - .) | tar -xf - -C "$WORK/src"
    fi
}

# Build the extension with the project's own build requirements (pip's isolated build env:
# pyproject.toml pins setuptools>=77, newer than a fresh venv's), then drop the compiled module
# into the copy (both extensions, lora._lora_cffi and lora._edge), so the copy imports exactly
# that build.  $1: extra LORA_CFLAGS.
build_into_copy() {
    local flags=()
    if [ -n "$1" ]; then flags=("LORA_CFLAGS=$1"); fi
    rm -rf "$WORK/wheel"
    (cd "$WORK/src" && env -u LORA_CFLAGS "${flags[@]}" "$PY" -m pip wheel -q --no-deps \
        --disable-pip-version-check -w "$WORK/wheel" .) >"$WORK/build.log" 2>&1 || return 1
    "$PY" - "$WORK/wheel" "$WORK/src/lora" <<'PYEOF'
import glob, os, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    mods = [n for n in z.namelist() if n.startswith(("lora/_lora_cffi", "lora/_edge"))
            and n.endswith((".so", ".pyd"))]
    for name in mods:
        with open(os.path.join(sys.argv[2], os.path.basename(name)), "wb") as fh:
            fh.write(z.read(name))
sys.exit(0 if len(mods) == 2 else f"expected lora/_lora_cffi and lora/_edge in {whl}; got {mods}")
PYEOF
}

# Begin a stage script: $1 the stage's name, $2 the variable that keeps its work directory when
# set to 1 (e.g. NEON_KEEP).  Sets WORK to a fresh temporary directory, removed on exit unless
# kept, and defines log and fail.
stage_begin() {
    STAGE_NAME="$1" STAGE_KEEP="$2" STAGE_START=$SECONDS
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/lora-$1.XXXXXX")"
    trap 'if [ "${!STAGE_KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi' EXIT
    log() { printf '[%s %4ds] %s\n' "$STAGE_NAME" "$((SECONDS - STAGE_START))" "$*"; }
    fail() { log "FAIL: $*"; exit 1; }
}

# Set PY to a Python that imports every module named ($@; each is also its package's name on
# the index): $PY itself, or a throwaway venv in $WORK with those packages.
python_with() {
    if ! "$PY" -c "import $(IFS=,; echo "$*")" >/dev/null 2>&1; then
        log "$PY lacks some of: $*; creating a throwaway venv"
        "$PY" -m venv "$WORK/venv"
        "$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
        PY="$WORK/venv/bin/python"
    fi
}

# Set PY to a Python that has the test dependencies (the suite without torch, PEFT, transformers).
python_with_test_deps() {
    python_with numpy cffi ml_dtypes safetensors gguf pytest hypothesis threadpoolctl
}
