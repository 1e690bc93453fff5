#!/usr/bin/env python
"""lora-kernels benchmark: the library against NumPy, PyTorch CPU and the machine's own limits.

Run from a checkout (after ``pip install .`` or ``python setup.py build_ext --inplace``)::

    python benchmarks/bench.py                    # full run (the machine decides the sweep's size)
    python benchmarks/bench.py --quick            # every code path, fewer repeats (CI runs this)
    python benchmarks/bench.py --threads 1 --json bench.json --plot bench.png

What is measured and how: ``benchmarks/lorabench/__init__.py``.  The script clears
``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` (by re-executing itself before NumPy is imported)
so that NumPy's OpenBLAS picks its own kernels, as it does for a user.  Exit status: 0, or 1 if
any workload raised or gave a wrong result (targets that miss, or are noisy, do not change it).
"""

import os
import sys

_OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_REEXEC_NOTE = "LORA_BENCH_CLEARED"  # = lorabench.cli.REEXEC_NOTE (not imported: that loads NumPy)


def _reexec_without_openblas_overrides():
    """OpenBLAS reads these once, when NumPy loads it: clear them and start over before that."""
    found = [k for k in _OPENBLAS_OVERRIDES if k in os.environ]
    if not found:
        return
    if "numpy" in sys.modules:  # too late to help; say so rather than loop
        print("bench: warning: NumPy already imported, cannot clear " + ", ".join(found), file=sys.stderr)
        return
    for k in found:
        os.environ.pop(k)
    os.environ[_REEXEC_NOTE] = ",".join(found)
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])


if __name__ == "__main__":
    _reexec_without_openblas_overrides()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lorabench.cli import main

    sys.exit(main(description=__doc__.split("\n\n")[0]))
