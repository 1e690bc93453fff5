"""Oversubscription: how much slower is a kernel call when a busy sibling shares the cores?

    python benchmarks/oversubscription.py            # ~1 minute
    python benchmarks/oversubscription.py --quick    # ~15 s, for CI smoke runs

A library inside someone's server shares the machine with other processes.  The target:
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

The ratio printed is ``loaded / serial``; ``ok`` when <= 2.0.  ``lorabench.oversub.measure()``
returns the same numbers to a caller.
"""

import argparse
import os
import platform
import sys

from lorabench import oversub
from lorabench.machine import cpu_info, import_lora


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, the spin load only")
    args = ap.parse_args()
    lora = import_lora()
    info = lora.kernel_info()
    print(f"machine: {cpu_info()['model']}, {os.cpu_count()} cpus, {platform.system()} "
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

    try:
        m = oversub.measure(args.quick)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    loads = m["loads"]
    print()
    hdr = f"{'environment':<25}{'shape':<28}{'serial ms':>10}{'threads ms':>11}"
    for load in loads:
        hdr += f"{'loaded[' + load + '] ms':>17}{'ratio':>7}{'1-thread':>10}"
    print(hdr)
    for res in m["results"]:
        for name, row in res["rows"].items():
            line = f"{res['policy']:<25}{name:<28}{row['serial'] * 1e3:>10.3f}" \
                   f"{row['threads'] * 1e3:>11.3f}"
            for load in loads:
                ratio = row[f"loaded[{load}]"] / row["serial"]
                line += f"{row[f'loaded[{load}]'] * 1e3:>17.3f}{ratio:>7.2f}" \
                        f"{row[f'loaded-1[{load}]'] / row['serial']:>10.2f}"
            print(line)
    print()
    for policy, ratio in m["worst"].items():
        verdict = "ok" if ratio <= oversub.TARGET_RATIO else f"over the {oversub.TARGET_RATIO:g}x target"
        print(f"worst loaded/serial with {policy}: {ratio:.2f} ({verdict})")
    print("ratio = all-thread call under load / one-thread call on an idle machine; "
          "'1-thread' = the same with set_num_threads(1) under load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
