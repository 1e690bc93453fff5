"""Oversubscription: how much slower is a kernel call when a busy sibling shares the cores?

    python benchmarks/oversubscription.py            # ~1 minute
    python benchmarks/oversubscription.py --quick    # ~15 s, for CI smoke runs

A library inside someone's server shares the machine with other processes.  The target (issue 7):
a call should stay within 2x of its *serial* time (one thread, idle machine) while a sibling
process keeps every core busy.  Measured, not asserted: the numbers depend on the machine and on
the kernel scheduler.

For each OpenMP environment -- the default (GNU OpenMP then spins for a while at every barrier
and at the end of every region before sleeping), ``OMP_WAIT_POLICY=passive`` (threads sleep at
once) and ``OMP_DYNAMIC=true`` (libgomp may shrink a team when the load average says the cores
are busy) -- a child process is started with that environment (libgomp reads it once, at
start-up) and times, as the median of many calls:

- ``serial``   one thread (``lora.set_num_threads(1)``), idle machine: the reference;
- ``threads``  all threads, idle machine;
- ``loaded``   all threads, with a sibling load running on every core;
- ``loaded-1`` one thread, with the same load (what ``set_num_threads(1)`` buys under load).

Each figure is a median over 20 ms windows of the mean time per call in the window: the cost of
sharing cores is paid by the calls a preemption lands in, which a per-call median would hide.

Loads: ``spin`` (one busy-looping process per core) and ``omp`` (a sibling process calling this
library's kernels with all threads in a loop, default wait policy: two OpenMP programs spinning
against each other).  Shapes: a decode (``add_to``, one block: the team splits ranks, meets at a
barrier, splits rows -- the most barrier-sensitive path) and a prefill (``add_batch_to``, threads
take whole blocks).  Both are above the library's work threshold (2^16 multiply-adds), below
which a call never wakes a team and so cannot be hurt by one.

The ratio printed is ``loaded / serial``; ``ok`` when <= 2.0.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:  # an installed lora-kernels, else the checkout this script lives in (built in place)
    import lora  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))
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


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    args = [sys.executable, __file__, "--load-process", kind]
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, the spin load only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load-process", choices=["spin", "omp"], help=argparse.SUPPRESS)
    ap.add_argument("--loads", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps, min_seconds = (10, 0.5) if args.quick else (25, 2.0)
    loads = ["spin"] if args.quick else ["spin", "omp"]
    if args.load_process == "spin":
        _spin()
    if args.load_process == "omp":
        _omp_sibling()
    if args.child:
        child(args.loads.split(","), reps, min_seconds)
        return 0

    import lora

    info = lora.kernel_info()
    print(f"machine: {_cpu_model()}, {os.cpu_count()} cpus, {platform.system()} "
          f"{platform.release()}, python {platform.python_version()}")
    print(f"lora {info['version']}: isa={info['isa']} openmp={info['openmp']} "
          f"threads={info['threads']} compiler={info['compiler']}")
    try:
        from threadpoolctl import threadpool_info

        for pool in threadpool_info():
            print(f"  threadpool: {pool.get('internal_api')} {pool.get('num_threads')} threads "
                  f"({os.path.basename(pool.get('filepath', ''))})")
    except ImportError:
        print("  (threadpoolctl not installed: no thread-pool listing)")
    if not info["openmp"] or info["threads"] < 2:
        print("one thread only (no OpenMP or one core): oversubscription cannot hurt a call")

    env_base = dict(os.environ)
    env_base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env_base.get("PYTHONPATH")]))
    env_base.pop("GOMP_SPINCOUNT", None)
    results = []
    for policy, extra in POLICIES.items():
        env = dict(env_base)
        for key in ("OMP_WAIT_POLICY", "OMP_DYNAMIC"):
            env.pop(key, None)
        env.update(extra, LORA_BENCH_POLICY=policy)
        out = subprocess.run([sys.executable, __file__, "--child", "--loads", ",".join(loads)]
                             + (["--quick"] if args.quick else []),
                             env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            print(out.stdout, out.stderr, file=sys.stderr)
            return 1
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))

    print()
    hdr = f"{'environment':<25}{'shape':<28}{'serial ms':>10}{'threads ms':>11}"
    for load in loads:
        hdr += f"{'loaded[' + load + '] ms':>17}{'ratio':>7}{'1-thread':>10}"
    print(hdr)
    worst = {}
    for res in results:
        for name, row in res["rows"].items():
            line = f"{res['policy']:<25}{name:<28}{row['serial'] * 1e3:>10.3f}" \
                   f"{row['threads'] * 1e3:>11.3f}"
            for load in loads:
                ratio = row[f"loaded[{load}]"] / row["serial"]
                worst[res["policy"]] = max(worst.get(res["policy"], 0.0), ratio)
                line += f"{row[f'loaded[{load}]'] * 1e3:>17.3f}{ratio:>7.2f}" \
                        f"{row[f'loaded-1[{load}]'] / row['serial']:>10.2f}"
            print(line)
    print()
    for policy, ratio in worst.items():
        verdict = "ok" if ratio <= 2.0 else "over the 2x target"
        print(f"worst loaded/serial with {policy}: {ratio:.2f} ({verdict})")
    print("ratio = all-thread call under load / one-thread call on an idle machine; "
          "'1-thread' = the same with set_num_threads(1) under load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
