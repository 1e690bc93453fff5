#!/usr/bin/env bash
# CI smoke stage: kernel calls while other work keeps every core busy (busy processes, and
# PyTorch's own OpenMP pool in the same process when torch is installed), default thread
# policy against one thread under the same load, plus OMP_WAIT_POLICY=passive for reference.
# Prints the figures; fails only on a gross regression (a mean >= 5x one thread's under the
# same load), never on the noise of a shared machine.  Run from the active venv (< 60 s).
set -euo pipefail
cd "$(dirname "$0")/.."
exec env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/oversubscription.py \
    --quick --loads procs,torch --fail-at 5
