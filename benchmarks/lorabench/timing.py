"""Timing: a pre-bound call in a loop, calibrated samples, rounds that visit every implementation.

``time.perf_counter_ns`` around a loop of calls to a pre-bound method (no other Python in the
loop), the loop length calibrated so that one sample lasts >= ``min_sample_s``; a discarded
warm-up before each block; ``rounds`` rounds that visit every implementation in turn,
``samples`` samples each; reported: the median per-call time and the min-max over all samples.

Descheduled samples.  On a busy machine a thread that waits for a CPU waits for the scheduler's
tick: a sample then lasts its own time plus about a whole number of ticks (4 ms at Linux's
default 250 Hz), far past the fastest this implementation ever ran (its *floor*: the fastest
sample or calibration call).  Where Linux says how long each thread waited on a run queue
(``/proc/self/task/*/schedstat``), every sample also records the time this process's threads
waited for a CPU, summed, over its wall time.  Such a sample says nothing about the code, so
`summarize` sets it apart (`descheduled`): the median the report and every ratio use is that of
the other samples, and an implementation left with too few of them has no median to compare
(``"clean": False``).  `measure` measures a block again when most of it was descheduled.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass

import numpy as np


def _loop0(fn, k):
    for _ in itertools.repeat(None, k):
        fn()


def _loop1(fn, a, k):
    for _ in itertools.repeat(None, k):
        fn(a)


def _loop2(fn, a, b, k):
    for _ in itertools.repeat(None, k):
        fn(a, b)


def _loop3(fn, a, b, c, k):
    for _ in itertools.repeat(None, k):
        fn(a, b, c)


def _loop4(fn, a, b, c, d, k):
    for _ in itertools.repeat(None, k):
        fn(a, b, c, d)


_LOOPS = {0: _loop0, 1: _loop1, 2: _loop2, 3: _loop3, 4: _loop4}


class Impl:
    """One way of computing a workload: a bound method and its arguments, called as fn(*args)."""

    __slots__ = ("fn", "args", "loop", "k", "keep", "before", "best", "waited")

    def __init__(self, fn, *args, before=None):
        self.fn, self.args, self.loop, self.k = fn, args, _LOOPS[len(args)], 1
        self.keep = None
        self.before = before  # called (untimed) before each of its blocks: state it needs, e.g. a scale
        self.best = math.inf  # the fastest per-call time of any calibration or warm-up run
        self.waited = []  # per sample: the time this process's threads waited for a CPU / its wall time

    def run(self, k):
        """Wall time in seconds of k back-to-back calls."""
        fn, args, loop = self.fn, self.args, self.loop
        t0 = time.perf_counter_ns()
        loop(fn, *args, k)
        t = (time.perf_counter_ns() - t0) * 1e-9
        self.best = min(self.best, t / k)
        return t


@dataclass
class TimingConfig:
    min_sample_s: float
    samples: int  # per round
    rounds: int
    impl_budget_s: float  # per implementation and round: fewer samples for slow ones (>= 2)
    settle_s: float  # idle time before each block, so other libraries' pools stop spinning
    warm_s: float = 0.02  # warm-up before each block (discarded)
    quiet_wait_s: float = 0.0  # --wait-quiet: longest wait for idle CPUs before re-measuring a block
    quiet_retries: int = 3
    tick_retries: int = 3  # measurements again of a block most of whose samples were descheduled


TICK_S = 0.004  # Linux's default scheduler tick (CONFIG_HZ=250); 1, 3.3 and 10 ms are the others
DESCHEDULED_RATIO = 1.5  # a descheduled sample took at least this many times its floor per call
DESCHEDULED_FAR = 2.75  # ticks past the floor that are descheduling wherever they fall
ON_GRID = 0.03  # a block within this many ticks of a whole number of them sits on the tick's grid
WAITED_ALL = 0.9  # a sample whose threads waited for a CPU this share of its wall time (summed) is the scheduler's
WAITED_SLOW = 0.25  # ... and one that waited this share and took 1.5x its floor


def run_queue_wait():
    """Seconds this process's threads have waited on a run queue for a CPU, summed over the
    threads alive now (Linux's schedstat), or None where it cannot be read."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
                continue
    except OSError:
        return None
    return total * 1e-9
CLEAN_LEAST = 2  # samples an implementation keeps, at least, to have a median worth a ratio


def descheduled(values, k, floor, tick=TICK_S, waited=None):
    """Which samples (seconds per call, `k` calls a sample) lost the CPU to the scheduler.

    * A block at least 1.5x the floor per call whose excess over what the floor would have made
      it sits within a quarter tick of a whole number of ticks (the tick's signature), or is
      past DESCHEDULED_FAR ticks (no call of the code's own spread gets there).  A block a
      fraction of a tick slower (a call that is 2x slower on its own, k times over) is the
      code's, and kept.
    * Blocks on the tick's grid: when most blocks lasted a whole number of ticks, each within
      ON_GRID of a tick (a call whose threads wait for a CPU on every call, so that even its
      floor is the tick's: NumPy's two BLAS threads took 31.99, 31.98 and 39.97 ms for a
      prefill its one-thread form ran in 0.25 ms), those blocks are the scheduler's.
    * `waited` (per sample, the share of its wall time this process's threads spent waiting
      for a CPU, summed; None: not known): a sample that waited WAITED_ALL of it, or WAITED_SLOW
      of it and took 1.5x the floor (torch's two threads took 35-49 ms a call for a 10 us
      prefill, waiting all along: no grid, and no faster call to compare with).

    Returns (a flag per sample, how many of the flagged sit near a whole number of ticks)."""
    grid = [round(v * k / tick) >= 1 and abs(v * k / tick - round(v * k / tick)) <= ON_GRID for v in values]
    on_grid = 2 * sum(grid) > len(values)
    waited = waited if waited is not None and len(waited) == len(values) else [None] * len(values)
    flags, quantized = [], 0
    for v, g, w in zip(values, grid, waited):
        q = (v - floor) * k / tick
        near = round(q) >= 1 and abs(q - round(q)) <= 0.25
        slow = v >= DESCHEDULED_RATIO * floor
        hit = (slow and (near or q >= DESCHEDULED_FAR)) or (on_grid and g)
        if w is not None:
            hit = hit or w >= WAITED_ALL or (slow and w >= WAITED_SLOW)
        flags.append(hit)
        quantized += hit and (near or g)
    return flags, quantized


def calibrate(impl, cfg):
    impl.run(1)  # first touch, thread pools awake
    # the fastest of a few single calls: one call that lost the CPU would make k far too small
    t1 = min(impl.run(1) for _ in range(3))
    k = max(1, math.ceil(cfg.min_sample_s / max(t1, 1e-8)))
    if k > 1:
        tk = impl.run(k)
        if tk < 0.8 * cfg.min_sample_s:
            k = max(k + 1, math.ceil(k * cfg.min_sample_s / max(tk, 1e-9)))
    impl.k = k


def measure(impls, cfg, progress, label, monitor=None):
    """Per-call samples (seconds) for every impl, and the most CPU other processes took during
    an accepted block; rounds visit the impls in turn.

    Each block starts with `settle_s` of sleep: OpenBLAS's idle workers spin for ~0.1 s after a
    call (2^28 cycles) and OpenMP's for a while too, and on a 2-core machine a spinning pool of
    the previous library slows the next one by 10-100x.  Then a discarded warm-up (the pool
    that slept must wake), then the samples.  With `cfg.quiet_wait_s`, a block during which
    other processes were busy is thrown away and measured again once they are idle (at most
    `cfg.quiet_retries` times).  A block most of whose samples were descheduled (see
    `descheduled`) is measured again too, up to `cfg.tick_retries` times (and within the
    attempts above), with or without `cfg.quiet_wait_s`; the samples of every block are kept
    (`summarize` sets the descheduled ones apart).  `monitor` is a ``machine.CpuMonitor`` (or None).
    """
    samples = {name: [] for name in impls}
    busy_max = None
    for r in range(cfg.rounds):
        for name, impl in impls.items():
            for attempt in range(cfg.quiet_retries + 1):
                progress(f"{label}: {name} (round {r + 1}/{cfg.rounds})" + (f", retry {attempt}" if attempt else ""))
                if cfg.quiet_wait_s and monitor is not None and attempt:
                    monitor.wait_quiet(cfg.quiet_wait_s, progress)
                time.sleep(cfg.settle_s)
                if impl.before is not None:
                    impl.before()
                if monitor is not None:
                    monitor.mark()
                if r == 0 and attempt == 0:
                    calibrate(impl, cfg)
                warm, t_end = 0.0, time.perf_counter() + cfg.warm_s
                while True:
                    warm = impl.run(impl.k)
                    if time.perf_counter() >= t_end:
                        break
                n = max(2, min(cfg.samples, int(cfg.impl_budget_s / max(warm, 1e-9))))
                block, waits = [], []
                for _ in range(n):
                    w0 = run_queue_wait()
                    t = impl.run(impl.k)
                    w1 = run_queue_wait()
                    block.append(t / impl.k)
                    waits.append(None if w0 is None or w1 is None else (w1 - w0) / max(t, 1e-9))
                busy = monitor.others() if monitor is not None else None
                floor = min(impl.best, *block, *samples[name])
                hit = sum(descheduled(block, impl.k, floor, waited=waits)[0])
                if attempt < min(cfg.tick_retries, cfg.quiet_retries) and 2 * hit > len(block):
                    samples[name].extend(block)  # kept: summarize sets them apart
                    impl.waited.extend(waits)
                    continue
                if monitor is None or not cfg.quiet_wait_s or attempt == cfg.quiet_retries or monitor.quiet_enough(busy):
                    break
            samples[name].extend(block)
            impl.waited.extend(waits)
            if busy is not None:
                busy_max = max(busy_max or 0.0, busy)
    return samples, busy_max


def summarize(values, k=1, best=math.inf, waited=None):
    """Median, min and max per call over every sample, with the descheduled ones set apart:
    ``median_s`` is the median of the others (``all_median_s``: of all), ``descheduled`` how
    many were set apart (``tick_quantized`` of them near a whole number of ticks), ``clean``
    whether at least `CLEAN_LEAST` samples (and a quarter) were not: a ratio needs it.  `k`:
    calls per sample; `best`: the fastest per-call time seen outside the samples; `waited`: per
    sample (in the order of `values`), the share of it this process's threads waited for a CPU."""
    order = sorted(range(len(values)), key=values.__getitem__)
    v = [values[i] for i in order]
    if waited is not None and len(waited) == len(values):
        waited = [waited[i] for i in order]
    flags, quantized = descheduled(v, k, min(v[0], best), waited=waited)
    kept = [x for x, f in zip(v, flags) if not f]
    clean = len(kept) >= max(CLEAN_LEAST, len(v) / 4) if len(v) > 1 else bool(kept)
    return {"median_s": float(np.median(kept if kept else v)), "min_s": v[0], "max_s": v[-1], "n": len(v),
            "all_median_s": float(np.median(v)), "descheduled": len(v) - len(kept), "tick_quantized": quantized,
            "clean": clean}
