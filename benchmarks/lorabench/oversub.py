"""The oversubscription measurement of ``benchmarks/oversubscription.py``, callable:
``measure(quick)`` returns the numbers (seconds per call) that script prints.

Each OpenMP environment runs in its own child process (``python -m lorabench.oversub --child``:
libgomp reads the environment once, at start-up); loads are more processes of this module
(``--load-process spin|omp``).  See ``benchmarks/oversubscription.py`` for what is timed and why.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCHMARKS)
TARGET_RATIO = 2.0  # loaded / serial: a call should stay within 2x of its serial time

# the environments compared, each in its own child process (libgomp reads them at start-up)
POLICIES = {
    "default": {},
    "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
    "OMP_DYNAMIC=true": {"OMP_DYNAMIC": "true"},
}
SHAPES = {
    # name: (rank, rows, cols, batch or None for decode)
    "decode 4096x4096 r64": (64, 4096, 4096, None),
    "prefill 2048x2048 r16 b64": (16, 2048, 2048, 64),
}


def _time_calls(fn, windows, min_seconds, window_s=0.02):
    """Seconds per call: the median over windows of (window time / calls in the window).

    Per-call medians would hide the load: a 20 us call mostly runs inside one scheduler time
    slice and is untouched; the cost of sharing a core shows up as the calls that straddle a
    preemption, i.e. in the mean over a window of many calls."""
    for _ in range(3):
        fn()
    per_call = []
    t_end = time.perf_counter() + min_seconds
    while len(per_call) < windows or time.perf_counter() < t_end:
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            t = time.perf_counter() - t0
            if t >= window_s:
                break
        per_call.append(t / n)
    return statistics.median(per_call)


def _workloads():
    import numpy as np

    import lora

    rng = np.random.default_rng(0)
    out = {}
    for name, (rank, rows, cols, batch) in SHAPES.items():
        d = lora.LoraDelta(rng.standard_normal((rank, cols)).astype(np.float32),
                           rng.standard_normal((rows, rank)).astype(np.float32))
        if batch is None:
            x = rng.standard_normal(cols).astype(np.float32)
            y = np.zeros(rows, np.float32)
            out[name] = (lambda d=d, x=x, y=y: d.add_to(x, y))
        else:
            x = rng.standard_normal((batch, cols)).astype(np.float32)
            y = np.zeros((batch, rows), np.float32)
            out[name] = (lambda d=d, x=x, y=y: d.add_batch_to(x, y))
    return out


def _spin():
    while True:
        pass


def _omp_sibling():
    import lora

    work = list(_workloads().values())
    lora.set_num_threads(os.cpu_count() or 1)
    while True:
        for fn in work:
            fn()


def _start_load(kind):
    n = os.cpu_count() or 1
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    args = [sys.executable, "-m", "lorabench.oversub", "--load-process", kind]
    count = n if kind == "spin" else 1
    procs = [subprocess.Popen(args, env=env) for _ in range(count)]
    time.sleep(0.5)  # let the load reach steady state
    return procs


def _stop_load(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def child(loads, reps, min_seconds):
    """Runs under one wait policy; prints one JSON line of medians in seconds."""
    import lora

    work = _workloads()
    nmax = lora.get_num_threads()
    res = {"threads": nmax, "policy": os.environ.get("LORA_BENCH_POLICY", "default"), "rows": {}}
    for name, fn in work.items():
        lora.set_num_threads(1)
        serial = _time_calls(fn, reps, min_seconds)
        lora.set_num_threads(nmax)
        threads = _time_calls(fn, reps, min_seconds)
        res["rows"][name] = {"serial": serial, "threads": threads}
    for load in loads:
        procs = _start_load(load)
        try:
            for name, fn in work.items():
                lora.set_num_threads(nmax)
                loaded = _time_calls(fn, reps, min_seconds)
                lora.set_num_threads(1)
                loaded1 = _time_calls(fn, reps, min_seconds)
                res["rows"][name][f"loaded[{load}]"] = loaded
                res["rows"][name][f"loaded-1[{load}]"] = loaded1
        finally:
            _stop_load(procs)
    lora.set_num_threads(nmax)
    print(json.dumps(res), flush=True)


def settings(quick):
    """(reps, min_seconds, loads) of a quick or a full measurement."""
    return (10, 0.5, ["spin"]) if quick else (25, 2.0, ["spin", "omp"])


def measure(quick=False, timeout=600):
    """Every policy's child result: {"loads": [...], "results": [{"threads", "policy", "rows":
    {shape: {"serial", "threads", "loaded[load]", "loaded-1[load]"}}}], "worst": {policy:
    largest loaded/serial}}; times in seconds per call.  Raises RuntimeError if a child fails."""
    _, _, loads = settings(quick)
    env_base = dict(os.environ)
    env_base["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, BENCHMARKS, env_base.get("PYTHONPATH")]))
    env_base.pop("GOMP_SPINCOUNT", None)
    results = []
    for policy, extra in POLICIES.items():
        env = dict(env_base)
        for key in ("OMP_WAIT_POLICY", "OMP_DYNAMIC"):
            env.pop(key, None)
        env.update(extra, LORA_BENCH_POLICY=policy)
        out = subprocess.run([sys.executable, "-m", "lorabench.oversub", "--child", "--loads", ",".join(loads)]
                             + (["--quick"] if quick else []),
                             env=env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{policy} child failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    worst = {}
    for res in results:
        for row in res["rows"].values():
            for load in loads:
                worst[res["policy"]] = max(worst.get(res["policy"], 0.0), row[f"loaded[{load}]"] / row["serial"])
    return {"loads": loads, "results": results, "worst": worst}


def _process_main():
    """The child and load processes' entry point."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--load-process", choices=["spin", "omp"])
    ap.add_argument("--loads", default="spin")
    args = ap.parse_args()
    if args.load_process == "spin":
        _spin()
    if args.load_process == "omp":
        _omp_sibling()
    if args.child:
        reps, min_seconds, _ = settings(args.quick)
        child(args.loads.split(","), reps, min_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(_process_main())
