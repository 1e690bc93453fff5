"""Start-up time: a fresh interpreter importing lora, and ``python -m lora info``.

Each command runs in a new process (nothing cached in this one can help it), with the lora this
benchmark measures first on its path, interleaved with a bare ``python -c pass`` (the
interpreter's own start-up, shown alongside so the import's share is visible).  The first run of
each is discarded (it warms the page cache and writes the bytecode caches, as installing a
package does: ``PYTHONDONTWRITEBYTECODE`` is cleared for these processes, else every run would
compile lora's modules anew); the rest give the median and min-max.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .timing import summarize

# row name -> the interpreter's arguments
COMMANDS = {
    "python -c 'import lora'": ("-c", "import lora"),
    "python -m lora info": ("-m", "lora", "info"),
}
_BARE = ("-c", "pass")


def _run_once(args, env, cwd):
    t0 = time.perf_counter_ns()
    proc = subprocess.run([sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    dt = (time.perf_counter_ns() - t0) * 1e-9
    if proc.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return dt


def measure(lora, args, runs, status, monitor=None, settle_s=0.0):
    """Wall time of `python *args` in fresh processes: a result row ({"impls": {"ours": ...,
    "python_bare": ...}, "others_cpu": ...}) shaped like the timed workloads'."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(lora.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    time.sleep(settle_s)  # our own thread pools stop spinning first
    if monitor is not None:
        monitor.mark()
    ours, bare = [], []
    for i in range(runs + 1):
        status(f"python {' '.join(args)}: run {i + 1}/{runs + 1}")
        t_ours, t_bare = _run_once(args, env, root), _run_once(_BARE, env, root)
        if i:  # the first run warms the page cache
            ours.append(t_ours)
            bare.append(t_bare)
    return {"command": [os.path.basename(sys.executable), *args], "runs": runs,
            "others_cpu": monitor.others() if monitor is not None else None,
            "impls": {"ours": summarize(ours), "python_bare": summarize(bare)}}
