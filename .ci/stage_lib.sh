# Shared by .ci/sanitize.sh and .ci/valgrind.sh (sourced; each sets ROOT, PY and WORK first).

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
# into the copy, so the copy imports exactly that build.  $1: extra LORA_CFLAGS.
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
    mods = [n for n in z.namelist() if n.startswith("lora/_lora_cffi") and n.endswith((".so", ".pyd"))]
    for name in mods:
        with open(os.path.join(sys.argv[2], os.path.basename(name)), "wb") as fh:
            fh.write(z.read(name))
sys.exit(0 if mods else "no compiled lora/_lora_cffi module in " + whl)
PYEOF
}
