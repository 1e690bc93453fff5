"""Oversubscription: a kernel call's time while other work keeps every core busy.

    python benchmarks/oversubscription.py            # ~1.5 minutes
    python benchmarks/oversubscription.py --quick    # ~20 s (the CI smoke stage)
    python benchmarks/oversubscription.py --json out.json

A library inside someone's server shares the machine.  The target: under load, with the default
settings, the mean time per call (its tail included) is at most 1.3x the mean time of the same
call on one thread (``lora.set_num_threads(1)``) under the same load.

From another script::

    from oversubscription import under_load      # benchmarks/ on sys.path
    res = under_load(quick=True)                 # a dict of numbers, printed nothing
    res["worst"]["default"]                      # the largest mean ratio to one thread

Loads (each a fresh child process, so the OpenMP runtime reads its environment at start-up):

- ``idle``   no load: the reference for the idle-machine speed;
- ``procs``  one busy-looping process per core;
- ``torch``  a thread of the measuring process runs PyTorch matmuls on all cores, so PyTorch's
  own OpenMP pool (a separate libgomp) keeps every core busy inside the same process.

Policies: ``default`` (the environment as the user has it, minus ``OMP_WAIT_POLICY``), and
``passive`` (``OMP_WAIT_POLICY=passive``, the setting a user could make by hand).  Each child
times, for every shape, blocks of calls of the policy's default thread count interleaved with
blocks of one-thread calls, and records every call: mean (tail included), median and p99.  The
ratios compare each to the one-thread calls of the same child, under the same load.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:  # an installed lora-kernels, else the checkout this script lives in (built in place)
    import lora  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

SHAPES = {
    # name: (kind, rank, rows, cols, batch)
    "decode 4096x4096 r16": ("decode", 16, 4096, 4096, 1),
    "decode 4096x4096 r8": ("decode", 8, 4096, 4096, 1),
    "prefill 4096x4096 r16 b64": ("prefill", 16, 4096, 4096, 64),
    "prefill 4096x4096 r16 b512": ("prefill", 16, 4096, 4096, 512),
    "bank 8x r16 4096x4096 b8": ("bank", 16, 4096, 4096, 8),
}
LOADS = ("idle", "procs", "torch")
POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "passive"}}
GROSS = 3.0  # the CI stage (.ci/load.sh --fail-at) fails at this mean ratio to one thread


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _workloads(shapes):
    import numpy as np

    import lora

    rng = np.random.default_rng(0)

    def delta(rank, rows, cols):
        return lora.LoraDelta(rng.standard_normal((rank, cols)).astype(np.float32),
                              rng.standard_normal((rows, rank)).astype(np.float32))

    out = {}
    for name in shapes:
        kind, rank, rows, cols, batch = SHAPES[name]
        x = rng.standard_normal((batch, cols)).astype(np.float32)
        y = np.zeros((batch, rows), np.float32)
        if kind == "decode":
            d = delta(rank, rows, cols)
            out[name] = (lambda d=d, x=x[0], y=y[0]: d.add_to(x, y))
        elif kind == "prefill":
            d = delta(rank, rows, cols)
            out[name] = (lambda d=d, x=x, y=y: d.add_batch_to(x, y))
        else:  # a bank of `batch` adapters, each position its own
            bank = lora.LoraBank([delta(rank, rows, cols) for _ in range(batch)])
            ids = np.arange(batch, dtype=np.int64)
            out[name] = (lambda b=bank, x=x, y=y, ids=ids: b.add_batch_to(x, y, ids))
    return out


def _stats(times_ns):
    s = sorted(times_ns)
    return {"mean": statistics.fmean(s) * 1e-9, "median": statistics.median(s) * 1e-9,
            "p99": s[min(len(s) - 1, int(0.99 * len(s)))] * 1e-9, "calls": len(s)}


def _time_blocks(fn, set_threads, nmax, rounds, window):
    """Per-call times (ns) of `rounds` blocks at nmax threads interleaved with blocks at one."""
    clock = time.perf_counter_ns
    times = {"threads": [], "one": []}
    for r in range(rounds):
        for mode in (("threads", "one") if r % 2 == 0 else ("one", "threads")):
            set_threads(nmax if mode == "threads" else 1)
            fn()
            out, end = times[mode], clock() + int(window * 1e9)
            n = 0
            while n < 3 or clock() < end:
                t0 = clock()
                fn()
                out.append(clock() - t0)
                n += 1
    set_threads(nmax)
    return times


def _torch_load(stop):
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.randn(512, 512)
    b = torch.randn(512, 512)
    while not stop.is_set():
        torch.mm(a, b)


def child(load, shapes, rounds, window, team_floor=None):
    """Runs in a child process under one policy and load; returns the result dict.  `team_floor`
    (log2 multiply-adds) replaces this core's team floor: another CPU table row's, reproduced."""
    import lora
    from lora._lora_cffi import lib

    if team_floor:
        lib.lora_team_set_min_work(1 << team_floor)

    stop = threading.Event()
    loader = None
    if load == "torch":
        import torch  # noqa: F401  (imported here, before the timing, like a server would)

        loader = threading.Thread(target=_torch_load, args=(stop,), daemon=True)
        loader.start()
        time.sleep(0.5)
    work = _workloads(shapes)
    nmax = lora.get_num_threads()
    res = {"threads": nmax, "load": load, "thread_policy": lora.kernel_info().get("thread_policy"),
           "shapes": {}}
    try:
        for name, fn in work.items():
            before = _team_stats(lib)
            times = _time_blocks(fn, lora.set_num_threads, nmax, rounds, window)
            after = _team_stats(lib)
            row = {mode: _stats(t) for mode, t in times.items()}
            if before is not None:
                row["team_calls"], row["team_lost"] = (a - b for a, b in zip(after, before))
            res["shapes"][name] = row
    finally:
        stop.set()
        if loader is not None:
            loader.join()
    return res


def _team_stats(lib):
    if not hasattr(lib, "lora_team_stats"):
        return None
    from lora._lora_cffi import ffi

    calls, lost = ffi.new("int64_t *"), ffi.new("int64_t *")
    lib.lora_team_stats(calls, lost)
    return calls[0], lost[0]


def _spin():
    while True:
        pass


def _start_procs():
    procs = [subprocess.Popen([sys.executable, __file__, "--spin"])
             for _ in range(os.cpu_count() or 1)]
    time.sleep(0.5)  # let the load reach steady state
    return procs


def _child_env(extra):
    import lora

    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    # the child imports the same lora as this process (an installed one, the checkout, or one
    # named by PYTHONPATH)
    where = str(Path(lora.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [where, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def under_load(loads=LOADS, shapes=tuple(SHAPES), policies=tuple(POLICIES), quick=False,
               rounds=None, window=None, team_floor=None):
    """Measure every shape under every load and policy; returns a dict of numbers (seconds).

    ``result["loads"][load][policy][shape]`` has ``threads`` and ``one`` (each ``mean``,
    ``median``, ``p99``, ``calls``) and ``ratio`` (``threads / one`` for each statistic);
    ``result["worst"][policy]`` is the largest mean ratio over the loaded runs (not ``idle``).
    A ``torch`` load is skipped (absent from the result) when PyTorch is not installed.
    """
    rounds = rounds or (4 if quick else 12)
    window = window or (0.025 if quick else 0.06)
    result = {"machine": f"{_cpu_model()}, {os.cpu_count()} cpus", "loads": {}, "worst": {}}
    for load in loads:
        if load == "torch":
            try:
                import torch  # noqa: F401
            except ImportError:
                continue
        result["loads"][load] = {}
        for policy in policies:
            procs = _start_procs() if load == "procs" else []
            try:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", load, "--shapes", ",".join(shapes),
                     "--rounds", str(rounds), "--window", str(window)]
                    + (["--team-floor", str(team_floor)] if team_floor else []),
                    env=_child_env(POLICIES[policy]), capture_output=True, text=True,
                    timeout=600)
            finally:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.wait()
            if out.returncode != 0:
                raise RuntimeError(f"measuring child failed ({load}, {policy}):\n{out.stderr}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            for row in res["shapes"].values():
                row["ratio"] = {k: row["threads"][k] / row["one"][k]
                                for k in ("mean", "median", "p99")}
                if load != "idle":
                    result["worst"][policy] = max(result["worst"].get(policy, 0.0),
                                                  row["ratio"]["mean"])
            res["policy"] = policy
            result["loads"][load][policy] = res
    return result


def print_table(result, out=sys.stdout):
    print(f"machine: {result['machine']}", file=out)
    first = next((r for per in result["loads"].values() for r in per.values()), None)
    if first:
        print(f"thread policy: {first.get('thread_policy')}", file=out)
    print(f"{'load':<7}{'policy':<9}{'shape':<28}{'one thread us':>22}{'default threads us':>24}"
          f"{'ratio mean/median/p99':>24}{'team calls':>12}", file=out)
    print(f"{'':<44}{'mean  median     p99':>22}{'mean  median     p99':>24}", file=out)
    for load, per in result["loads"].items():
        for policy, res in per.items():
            for name, row in res["shapes"].items():
                one, thr, rat = row["one"], row["threads"], row["ratio"]
                teams = (f"{row['team_lost']}/{row['team_calls']} lost"
                         if "team_calls" in row else "")
                print(f"{load:<7}{policy:<9}{name:<28}"
                      f"{one['mean'] * 1e6:>7.0f} {one['median'] * 1e6:>6.0f} "
                      f"{one['p99'] * 1e6:>7.0f}"
                      f"{thr['mean'] * 1e6:>9.0f} {thr['median'] * 1e6:>6.0f} "
                      f"{thr['p99'] * 1e6:>7.0f}"
                      f"{rat['mean']:>10.2f} {rat['median']:>5.2f} {rat['p99']:>6.2f}"
                      f"{teams:>14}", file=out)
    for policy, worst in result["worst"].items():
        print(f"worst mean ratio to one thread under load, {policy}: {worst:.2f}", file=out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter blocks (CI smoke)")
    ap.add_argument("--loads", default=",".join(LOADS), help="comma list of " + ", ".join(LOADS))
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list: default, passive")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    ap.add_argument("--fail-at", type=float, default=None, metavar="RATIO",
                    help="exit 1 when the default policy's worst mean ratio under load >= RATIO")
    ap.add_argument("--team-floor", type=int, default=None, metavar="LOG2",
                    help="run the calls with this team floor (2^LOG2 multiply-adds; e.g. 17, the "
                    "Zen 4 row of csrc/isa.c's CPU table) instead of this core's")
    ap.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=LOADS, help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--window", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.spin:
        _spin()
    if args.child:
        print(json.dumps(child(args.child, args.shapes.split(","), args.rounds, args.window,
                               args.team_floor)), flush=True)
        return 0
    result = under_load(loads=args.loads.split(","), policies=args.policies.split(","),
                        quick=args.quick, rounds=args.rounds, window=args.window,
                        team_floor=args.team_floor)
    print_table(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    worst = result["worst"].get("default")
    if args.fail_at is not None and worst is not None and worst >= args.fail_at:
        print(f"FAIL: a call under load took {worst:.2f}x its one-thread time "
              f"(gross-regression bound {args.fail_at:g}x)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
