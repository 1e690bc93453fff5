#!/usr/bin/env python
"""lora-kernels benchmark: the library against NumPy, PyTorch CPU and the machine's own limits.

Run from a checkout (after ``pip install .`` or ``python setup.py build_ext --inplace``)::

    python benchmarks/bench.py                    # full run, < 10 min on 2 cores
    python benchmarks/bench.py --quick            # every code path, < 60 s (CI runs this)
    python benchmarks/bench.py --threads 1 --json bench.json --plot bench.png

What is measured
----------------
Every workload goes through the public Python API (``LoraDelta.add_to`` and friends), end to end,
and is compared in the same run, at the same thread count, with

* NumPy naive:  ``out += s * (B @ (A @ x))``; batches ``out += s * ((x @ A.T) @ B.T)``;
  token rows ``out += s * (B[ids] @ A)``; mixed batches: a loop over ``np.unique(ids)`` with
  fancy indexing (what PEFT's mixed-batch forward does, in NumPy);
* NumPy tuned:  preallocated buffers, ``np.matmul(..., out=)``, the scale applied to the
  rank-sized intermediate in place, ``np.add(out, z, out=out)``;
* PyTorch CPU (when importable, and not ``--no-torch``): ``torch.matmul(out=)`` then
  ``out.addmv_`` / ``out.addmm_(..., alpha=s)`` on ``torch.from_numpy`` views (no copies); for
  float16 / bfloat16 rows the adapters are stored in that dtype in torch as well; mixed batches:
  the per-token gather + einsum of vLLM's CPU LoRA path, and PEFT-style grouping in torch.

Half-precision rows (adapters stored as float16 / bfloat16, activations float32) are compared
with the float32 NumPy baselines of the same shape (a NumPy user has no fast half matmul) and
with our own float32 row (``vs f32``).

Timing: ``time.perf_counter_ns`` around a loop of calls to a pre-bound method (no other Python
in the loop), the loop length calibrated so that one sample lasts >= ``--min-sample-ms``; a
discarded warm-up sample before each block; ``--rounds`` rounds that visit every implementation
in turn, ``--samples`` samples each; reported: the median per-call time and the min-max over
all samples.  Outputs accumulate across calls (the values only grow; nothing is reset inside
the timed loop).  Before timing, each workload's result is checked against NumPy once.

Bytes / flops model (compulsory traffic of one call; ``w`` = storage itemsize of A and B,
4 for float32, 2 for float16 / bfloat16; activations and outputs are float32)
--------------------------------------------------------------------------------------------
* linear, ``add_to`` / ``add_batch_to`` (batch ``n``, 1 for decode):
  bytes = rank*(rows+cols)*w  +  n*cols*4 (read x)  +  n*rows*4*2 (read and write out);
  flops = 2*n*rank*(rows+cols)  (A@x, then B@y; the scale is O(n*rank) and not counted).
* stack of k deltas: the sum of the k adapters' bytes and flops, x and out counted once.
* token rows, ``add_row_to`` (n=1) / ``add_rows_to`` (n ids, u of them distinct):
  bytes = rank*cols*w (A) + u*rank*w (rows of B) + n*cols*4*2 (out) + n*8 (ids);
  flops = 2*n*rank*cols.
* model sweep: the sum over its deltas of the decode model.
* mixed batch (``LoraBank``), m positions with an adapter (id != -1), u distinct adapters used:
  bytes = sum over used adapters of rank*(rows+cols)*w + m*(cols*4 + rows*4*2) + n*8 (ids);
  flops = 2*m*rank*(rows+cols).
GB/s and GFLOP/s are these numbers over the median time.

Roofline
--------
The read bandwidth of each memory level is measured with the extension's C read
kernel ``lora_bench_read`` (OpenMP, same thread count, best of N rounds over all levels, at
start-up and again at the end, keeping the better figure) on
buffers of half the per-core L1d and L2 per thread, a slice of the L3 and a buffer of 4x the L3
(>= 256 MiB, <= 2 GiB) for DRAM.  A workload's working set (= its bytes per call, which the timed loop re-reads every
call) lives in the smallest level that holds it: L1/L2 if bytes/threads <= 3/4 of the per-core
cache, L3 if bytes <= 1/2 of the L3, else DRAM.  The model sweep is the exception: its bandwidth
is that of the read kernel on a buffer as large as the sweep's working set, measured interleaved
with it (on a CPU whose L3 is nearly as large as the 155 MB sweep, part of it stays in L3); its
DRAM target divides by the DRAM figure, also re-measured alongside.  The lower bound of a call's
time is max(bytes / bandwidth(level), flops / peak), with peak = threads x nominal GHz x SIMD lanes
x 2 (FMA) x 2 FMA ports; "% roof" is that bound over the measured median.

The script clears ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` (by re-executing itself before
NumPy is imported) so that NumPy's OpenBLAS picks its own kernels, as it does for a user.
Exit status: 0, or 1 if any workload raised or gave a wrong result (targets that miss do not
change it).
"""

from __future__ import annotations

import os
import sys

_OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_REEXEC_NOTE = "LORA_BENCH_CLEARED"


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

import argparse  # noqa: E402
import glob  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------------------------
# machine description
# --------------------------------------------------------------------------------------------

# Intel family-6 model numbers of recent server / client cores (KVM guests often hide the name).
_INTEL_MODELS = {
    85: "Skylake-SP / Cascade Lake", 106: "Ice Lake-SP", 108: "Ice Lake-D", 143: "Sapphire Rapids",
    207: "Emerald Rapids", 173: "Granite Rapids", 151: "Alder Lake", 183: "Raptor Lake",
    140: "Tiger Lake", 126: "Ice Lake",
}


def _read(path, default=None):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMGB") or 0) * mult


def cpu_info():
    info = {"model": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["usable_cpus"] = os.cpu_count()
    text = _read("/proc/cpuinfo", "")
    fields = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = (s.strip() for s in line.split(":", 1))
            fields.setdefault(k, v)
    if "model name" in fields:
        info["model"] = fields["model name"]
    if fields.get("cpu family") and fields.get("model"):
        fam, mod = int(fields["cpu family"]), int(fields["model"])
        info["family_model"] = f"family {fam} model {mod} stepping {fields.get('stepping', '?')}"
        if fields.get("vendor_id") == "GenuineIntel" and fam == 6 and mod in _INTEL_MODELS:
            info["microarchitecture"] = _INTEL_MODELS[mod]
    if "cpu MHz" in fields:
        info["mhz"] = float(fields["cpu MHz"])
    if "flags" in fields:
        flags = set(fields["flags"].split())
        info["simd_flags"] = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16",
                                          "avx512_fp16", "amx_bf16") if f in flags]
    # caches of cpu0 (sysfs); defaults where unknown (macOS, containers without sysfs)
    caches = {"L1d": 32 << 10, "L2": 1 << 20, "L3": 32 << 20}
    found = False
    for idx in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        level, ctype, size = _read(idx + "/level"), _read(idx + "/type"), _read(idx + "/size")
        if not (level and ctype and size) or ctype == "Instruction":
            continue
        name = "L1d" if level == "1" else f"L{level}"
        caches[name] = _parse_size(size)
        found = True
    info["caches"] = caches
    info["caches_source"] = "sysfs" if found else "defaults (not detected)"
    return info


def fmt_bytes(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v >= 10 or v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def fmt_time(s):
    if s is None or not math.isfinite(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.2f} µs" if s < 1e-5 else f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms" if s < 1e-2 else f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_range(lo, hi):
    """min-max in the unit of the larger end."""
    scale, unit = (1e6, "µs") if hi < 1e-3 else ((1e3, "ms") if hi < 1 else (1, "s"))
    digits = 2 if hi * scale < 10 else 1 if hi * scale < 100 else 0
    return f"{lo * scale:.{digits}f}-{hi * scale:.{digits}f} {unit}"


# --------------------------------------------------------------------------------------------
# imports that may be missing
# --------------------------------------------------------------------------------------------


def import_lora():
    """Prefer an in-place build of this checkout (build_ext --inplace) over an installed copy."""
    if glob.glob(os.path.join(_REPO, "lora", "_lora_cffi*")):
        sys.path.insert(0, _REPO)
    import lora

    return lora


def import_torch(disabled):
    if disabled:
        return None, "PyTorch baselines skipped (--no-torch)"
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        return None, f"PyTorch not importable ({type(e).__name__}: {e}): PyTorch baselines skipped"
    return torch, None


# --------------------------------------------------------------------------------------------
# bandwidth and peak
# --------------------------------------------------------------------------------------------

LEVELS = ("L1", "L2", "L3", "DRAM")


def bandwidth_buffers(caches, threads):
    """Buffer size (bytes) per level, as documented in the module docstring."""
    l1, l2, l3 = caches["L1d"], caches["L2"], caches["L3"]
    l3_buf = min(max(l3 // 8, 4 * l2 * threads), l3 // 2)
    dram = max(4 * l3, 256 << 20)
    dram = min(dram, 2 << 30)
    return {"L1": l1 // 2 * threads, "L2": l2 // 2 * threads, "L3": l3_buf, "DRAM": dram}


def measure_bandwidth(threads, caches, trials, progress, monitor=None, quiet_wait_s=0.0, retries=3):
    """Read bandwidth per level with the extension's C kernel, bytes/s: the best of `trials`
    rounds, each round visiting every level (a noisy second on a shared machine then spoils one
    trial of each level, not all trials of one).  With `quiet_wait_s`, a round during which other
    processes were busy is repeated once they are idle."""
    from lora._lora_cffi import ffi, lib  # the private bench kernel, see the module docstring

    read = lib.lora_bench_read
    bufs = {}
    for level, nbytes in bandwidth_buffers(caches, threads).items():
        progress(f"bandwidth: allocating {level} buffer ({fmt_bytes(nbytes)})")
        n = (nbytes // 4) // 64 * 64
        buf = np.ones(n, dtype=np.float32)  # written: paged in
        reps = max(1, int(512e6 // (n * 4)))  # >= 512 MB read per trial (>= 1 ms even from L1)
        bufs[level] = (buf, ffi.from_buffer("float[]", buf), n, reps)
    time.sleep(0.2)  # let pools started by the set-up (OpenBLAS spins ~0.1 s) go idle
    best = dict.fromkeys(bufs, math.inf)
    for t in range(trials):
        for attempt in range(retries + 1):
            progress(f"bandwidth: trial {t + 1}/{trials}" + (f", retry {attempt}" if attempt else ""))
            if attempt and quiet_wait_s and monitor is not None:
                wait_quiet(monitor, quiet_wait_s, progress)
            if monitor is not None:
                monitor.mark()
            times = {}
            for level, (_, ptr, n, reps) in bufs.items():
                read(ptr, n, 1, threads)  # warm this level
                t0 = time.perf_counter_ns()
                read(ptr, n, reps, threads)
                times[level] = (time.perf_counter_ns() - t0) * 1e-9
            busy = monitor.others() if monitor is not None else None
            if busy is None or busy <= _BUSY or not quiet_wait_s or attempt == retries:
                break
        for level, dt in times.items():
            best[level] = min(best[level], dt)
    out = {lv: {"buffer_bytes": n * 4, "reps": reps, "bytes_per_s": n * 4 * reps / best[lv]}
           for lv, (_, _, n, reps) in bufs.items()}
    buf, _, n, _ = bufs["DRAM"]  # kept: the sweep re-measures DRAM interleaved with itself
    return out, make_reader(buf, threads)


def make_reader(buf, threads):
    """An Impl that reads the float32 array `buf` once with the C read kernel (a reference)."""
    from lora._lora_cffi import ffi, lib

    r = Impl(lib.lora_bench_read, ffi.from_buffer("float[]", buf), buf.size, 1, threads)
    r.keep = buf
    return r


_LANES = {"avx512": 16, "avx2": 8, "neon": 4, "scalar": 1}


def peak_flops(threads, mhz, isa):
    """Nominal peak: threads x GHz x lanes x 2 (FMA) x 2 FMA ports (an assumption, documented)."""
    if not mhz:
        return None
    return threads * mhz * 1e6 * _LANES.get(isa, 1) * 2 * 2


def level_for(ws_bytes, threads, caches):
    per_thread = ws_bytes / threads
    if per_thread <= 0.75 * caches["L1d"]:
        return "L1"
    if per_thread <= 0.75 * caches["L2"]:
        return "L2"
    if ws_bytes <= 0.5 * caches["L3"]:
        return "L3"
    return "DRAM"


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def _loop0(fn, k):
    for _ in itertools.repeat(None, k):
        fn()


def _loop2(fn, a, b, k):
    for _ in itertools.repeat(None, k):
        fn(a, b)


def _loop3(fn, a, b, c, k):
    for _ in itertools.repeat(None, k):
        fn(a, b, c)


def _loop4(fn, a, b, c, d, k):
    for _ in itertools.repeat(None, k):
        fn(a, b, c, d)


_LOOPS = {0: _loop0, 2: _loop2, 3: _loop3, 4: _loop4}


class Impl:
    """One way of computing a workload: a bound method and its arguments, called as fn(*args)."""

    __slots__ = ("fn", "args", "loop", "k", "keep")

    def __init__(self, fn, *args):
        self.fn, self.args, self.loop, self.k = fn, args, _LOOPS[len(args)], 1

    def run(self, k):
        """Wall time in seconds of k back-to-back calls."""
        fn, args, loop = self.fn, self.args, self.loop
        t0 = time.perf_counter_ns()
        loop(fn, *args, k)
        return (time.perf_counter_ns() - t0) * 1e-9


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


def calibrate(impl, cfg):
    impl.run(1)  # first touch, thread pools awake
    t1 = impl.run(1)
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
    `cfg.quiet_retries` times).
    """
    samples = {name: [] for name in impls}
    busy_max = None
    for r in range(cfg.rounds):
        for name, impl in impls.items():
            for attempt in range(cfg.quiet_retries + 1):
                progress(f"{label}: {name} (round {r + 1}/{cfg.rounds})" + (f", retry {attempt}" if attempt else ""))
                if cfg.quiet_wait_s and monitor is not None and attempt:
                    wait_quiet(monitor, cfg.quiet_wait_s, progress)
                time.sleep(cfg.settle_s)
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
                block = [impl.run(impl.k) / impl.k for _ in range(n)]
                busy = monitor.others() if monitor is not None else None
                if busy is None or busy <= _BUSY or not cfg.quiet_wait_s or attempt == cfg.quiet_retries:
                    break
            samples[name].extend(block)
            if busy is not None:
                busy_max = max(busy_max or 0.0, busy)
    return samples, busy_max


class CpuMonitor:
    """CPU time other processes (and the hypervisor: steal) took while we measured.

    On a small shared machine a second busy process turns every 2-thread handoff into a wait for
    a scheduler tick (4-8 ms per call instead of 60 µs): such numbers are flagged, not trusted.
    Linux only (/proc/stat); elsewhere it reports nothing.
    """

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.ok = os.path.exists("/proc/stat")
        self.mark()

    def _busy(self):
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        return (v[0] + v[1] + v[2] + v[5] + v[6]) / self.hz, (v[7] if len(v) > 7 else 0) / self.hz

    def mark(self):
        self.t0 = time.monotonic()
        if self.ok:
            self.busy0, self.steal0 = self._busy()
            t = os.times()
            self.own0 = t.user + t.system

    def others(self):
        """CPUs' worth (e.g. 0.9 = most of one core) used by others since mark(), incl. steal."""
        if not self.ok:
            return None
        busy, steal = self._busy()
        t = os.times()
        wall = max(time.monotonic() - self.t0, 1e-3)
        other = (busy - self.busy0) - (t.user + t.system - self.own0) + (steal - self.steal0)
        return max(0.0, other / wall)


def wait_quiet(monitor, budget_s, status):
    """Sleep in 0.5 s steps until other processes use < 0.1 CPU, for at most budget_s seconds."""
    end = time.monotonic() + budget_s
    while time.monotonic() < end:
        monitor.mark()
        time.sleep(0.5)
        busy = monitor.others()
        if busy is None or busy < 0.1:
            return True
        status(f"waiting for a quiet machine (others use {busy:.1f} CPU)")
    return False


def summarize(values):
    v = sorted(values)
    return {"median_s": float(np.median(v)), "min_s": v[0], "max_s": v[-1], "n": len(v)}


# --------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------


class Skip(Exception):
    """A workload this build or environment cannot run (not an error)."""


@dataclass
class Built:
    impls: dict  # name -> Impl; "ours" first
    bytes: int
    flops: int
    check: tuple = None  # (ours_fn, reference_fn, tolerance): each returns a fresh result array


@dataclass(eq=False)
class Workload:
    name: str
    group: str
    dtype: str
    build: object  # ctx -> Built
    key: str = ""  # shape key shared by the float32 twin of a half-precision row
    result: dict = field(default_factory=dict)


def _rand(rng, shape, amp):
    a = rng.random(shape, dtype=np.float32)
    a -= 0.5
    a *= 2 * amp
    return a


def _pair(rng, rows, cols, rank):
    """A [rank, cols], B [rows, rank] with values of realistic size (|A x| ~ 1, |delta| ~ 1e-2)."""
    return _rand(rng, (rank, cols), 1.7 / math.sqrt(cols)), _rand(rng, (rows, rank), 0.02)


def _half_torch(torch, dtype):
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def _make_delta(lora, a, b, dtype, rank):
    """A LoraDelta with effective scale 2 (alpha = 2*rank); Skip if this build lacks the dtype."""
    try:
        d = lora.LoraDelta(a, b, alpha=2.0 * rank, dtype=dtype)
    except (TypeError, ValueError, NotImplementedError) as e:
        if dtype != "float32":
            raise Skip(f"LoraDelta(dtype={dtype!r}) not supported by this build: {e}") from None
        raise
    return d


def _scale_of(d, rank):
    s = getattr(d, "effective_scale", None)
    return float(s) if s is not None else 2.0


def linear_model(rows, cols, ranks, n, w):
    nbytes = sum(r * (rows + cols) * w for r in ranks) + n * cols * 4 + n * rows * 8
    flops = sum(2 * n * r * (rows + cols) for r in ranks)
    return nbytes, flops


def build_linear(ctx, rows, cols, ranks, batch, dtype):
    """decode (batch None: add_to on 1-D), prefill (add_batch_to) and stacks (len(ranks) > 1)."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    pairs = [_pair(rng, rows, cols, r) for r in ranks]
    deltas = [_make_delta(lora, a, b, dtype, r) for (a, b), r in zip(pairs, ranks)]
    ours = deltas[0] if len(deltas) == 1 else lora.LoraStack(deltas)
    scales = [_scale_of(d, r) for d, r in zip(deltas, ranks)]
    n = 1 if batch is None else batch
    xshape = (cols,) if batch is None else (batch, cols)
    oshape = (rows,) if batch is None else (batch, rows)
    x = _rand(rng, xshape, 1.0)

    def zeros():
        return np.zeros(oshape, np.float32)

    out = zeros()
    method = ours.add_to if batch is None else ours.add_batch_to
    impls = {"ours": Impl(method, x, out)}
    mm, add, mul = np.matmul, np.add, np.multiply
    trip = [(a, b, s) for (a, b), s in zip(pairs, scales)]

    if dtype == "float32":
        o_naive, o_tuned = zeros(), zeros()
        if batch is None:
            def naive(o=o_naive, x=x, trip=trip):
                for a, b, s in trip:
                    o += s * (b @ (a @ x))

            bufs = [(a, b, s, np.empty(a.shape[0], np.float32), np.empty(rows, np.float32)) for a, b, s in trip]

            def tuned(o=o_tuned, x=x, bufs=bufs, mm=mm, add=add, mul=mul):
                for a, b, s, y, z in bufs:
                    mm(a, x, out=y)
                    mul(y, s, out=y)
                    mm(b, y, out=z)
                    add(o, z, out=o)
        else:
            def naive(o=o_naive, x=x, trip=trip):
                for a, b, s in trip:
                    o += s * ((x @ a.T) @ b.T)

            bufs = [(a.T, b.T, s, np.empty((batch, a.shape[0]), np.float32), np.empty(oshape, np.float32))
                    for a, b, s in trip]

            def tuned(o=o_tuned, x=x, bufs=bufs, mm=mm, add=add, mul=mul):
                for at, bt, s, y, z in bufs:
                    mm(x, at, out=y)
                    mul(y, s, out=y)
                    mm(y, bt, out=z)
                    add(o, z, out=o)

        impls["numpy_naive"] = Impl(naive)
        impls["numpy_tuned"] = Impl(tuned)

    if torch is not None:
        o_t = torch.from_numpy(zeros())
        x_t = torch.from_numpy(x)
        tm = torch.matmul
        if dtype == "float32":
            if batch is None:
                tb = [(torch.from_numpy(a), torch.from_numpy(b), s, torch.empty(a.shape[0])) for a, b, s in trip]

                def torch_fn(o=o_t, x=x_t, tb=tb, tm=tm):
                    for a, b, s, y in tb:
                        tm(a, x, out=y)
                        o.addmv_(b, y, alpha=s)
            else:
                tb = [(torch.from_numpy(a).T, torch.from_numpy(b).T, s, torch.empty(batch, a.shape[0]))
                      for a, b, s in trip]

                def torch_fn(o=o_t, x=x_t, tb=tb, tm=tm):
                    for at, bt, s, y in tb:
                        tm(x, at, out=y)
                        o.addmm_(y, bt, alpha=s)
        else:
            hd = _half_torch(torch, dtype)
            xh = torch.empty(xshape, dtype=hd)
            if batch is None:
                tb = [(torch.from_numpy(a).to(hd), torch.from_numpy(b).to(hd), s,
                       torch.empty(a.shape[0], dtype=hd), torch.empty(rows, dtype=hd)) for a, b, s in trip]

                def torch_fn(o=o_t, x=x_t, xh=xh, tb=tb, tm=tm):
                    xh.copy_(x)
                    for a, b, s, y, z in tb:
                        tm(a, xh, out=y)
                        tm(b, y, out=z)
                        o.add_(z, alpha=s)
            else:
                tb = [(torch.from_numpy(a).to(hd).T, torch.from_numpy(b).to(hd).T, s,
                       torch.empty(batch, a.shape[0], dtype=hd), torch.empty(oshape, dtype=hd))
                      for a, b, s in trip]

                def torch_fn(o=o_t, x=x_t, xh=xh, tb=tb, tm=tm):
                    xh.copy_(x)
                    for at, bt, s, y, z in tb:
                        tm(xh, at, out=y)
                        tm(y, bt, out=z)
                        o.add_(z, alpha=s)

        impls["torch"] = Impl(torch_fn)

    def ours_once():
        o = zeros()
        method(x, o)
        return o

    def ref_once():
        o = np.zeros(oshape, np.float64)
        x64 = x.astype(np.float64)
        for a, b, s in trip:
            if batch is None:
                o += s * (b.astype(np.float64) @ (a.astype(np.float64) @ x64))
            else:
                o += s * ((x64 @ a.T.astype(np.float64)) @ b.T.astype(np.float64))
        return o

    w = 4 if dtype == "float32" else 2
    nbytes, flops = linear_model(rows, cols, ranks, n, w)
    return Built(impls, nbytes, flops, (ours_once, ref_once, _TOL[dtype]))


# relative-norm tolerance of the sanity check against float64 (half storage rounds A and B)
_TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def build_gather(ctx, vocab, dim, rank, n):
    """Token-embedding deltas: add_row_to (n == 1) or add_rows_to (n ids)."""
    lora, torch, rng = ctx.lora, ctx.torch, ctx.rng
    a, b = _pair(rng, vocab, dim, rank)  # A [rank, dim], B [vocab, rank]: row t of s B A
    d = _make_delta(lora, a, b, "float32", rank)
    s = _scale_of(d, rank)
    mm, add, mul = np.matmul, np.add, np.multiply
    if n == 1:
        r = int(rng.integers(vocab))
        oshape = (dim,)
        method, first = d.add_row_to, r
        ids_count = 1
    else:
        ids = rng.integers(0, vocab, size=n, dtype=np.int64)
        oshape = (n, dim)
        method, first = d.add_rows_to, ids
        ids_count = len(np.unique(ids))

    def zeros():
        return np.zeros(oshape, np.float32)

    impls = {"ours": Impl(method, first, zeros())}
    if n == 1:
        def naive(o=zeros(), a=a, b=b, r=r, s=s):
            o += s * (b[r] @ a)

        g, z = np.empty(rank, np.float32), np.empty(dim, np.float32)

        def tuned(o=zeros(), a=a, b=b, r=r, s=s, g=g, z=z):
            mul(b[r], s, out=g)
            mm(g, a, out=z)
            add(o, z, out=o)
    else:
        def naive(o=zeros(), a=a, b=b, ids=ids, s=s):
            o += s * (b[ids] @ a)

        g, z = np.empty((n, rank), np.float32), np.empty(oshape, np.float32)

        def tuned(o=zeros(), a=a, b=b, ids=ids, s=s, g=g, z=z, take=np.take):
            take(b, ids, axis=0, out=g)
            mul(g, s, out=g)
            mm(g, a, out=z)
            add(o, z, out=o)
    impls["numpy_naive"] = Impl(naive)
    impls["numpy_tuned"] = Impl(tuned)
    if torch is not None:
        a_t, b_t = torch.from_numpy(a), torch.from_numpy(b)
        if n == 1:
            def torch_fn(o=torch.from_numpy(zeros()), at=a_t.T, b=b_t, r=r, s=s):
                o.addmv_(at, b[r], alpha=s)
        else:
            def torch_fn(o=torch.from_numpy(zeros()), a=a_t, b=b_t, ids=torch.from_numpy(ids), s=s,
                         g=torch.empty(n, rank), sel=torch.index_select):
                sel(b, 0, ids, out=g)
                o.addmm_(g, a, alpha=s)
        impls["torch"] = Impl(torch_fn)

    def ours_once():
        o = zeros()
        method(first, o)
        return o

    def ref_once():
        rows_ = b[first] if n == 1 else b[ids]
        return s * (rows_.astype(np.float64) @ a.astype(np.float64))

    nbytes = rank * dim * 4 + ids_count * rank * 4 + n * dim * 8 + (n * 8 if n > 1 else 0)
    return Built(impls, nbytes, 2 * n * rank * dim, (ours_once, ref_once, _TOL["float32"]))


LLAMA2_7B = (("q", 4096, 4096), ("k", 4096, 4096), ("v", 4096, 4096), ("o", 4096, 4096),
             ("gate", 11008, 4096), ("up", 11008, 4096), ("down", 4096, 11008))


def sweep_pairs(ctx, layers, rank):
    """The float32 adapters of the sweep, shared by its float32/f16/bf16 rows (cached)."""
    key = ("sweep", layers, rank)
    if key not in ctx.cache:
        rng = np.random.default_rng(7)
        ctx.cache[key] = [(rows, cols, *_pair(rng, rows, cols, rank))
                          for _ in range(layers) for _, rows, cols in LLAMA2_7B]
    return ctx.cache[key]


def build_sweep(ctx, layers, rank, dtype):
    """One decode token through every adapted projection of a Llama-2-7B-shaped model."""
    lora, torch = ctx.lora, ctx.torch
    pairs = sweep_pairs(ctx, layers, rank)
    rng = np.random.default_rng(8)
    xs = {c: _rand(rng, (c,), 1.0) for c in (4096, 11008)}

    def outs():
        return {r: np.zeros(r, np.float32) for r in (4096, 11008)}

    deltas = [_make_delta(lora, a, b, dtype, rank) for _, _, a, b in pairs]
    s = _scale_of(deltas[0], rank)
    o_ours = outs()
    calls = [(d.add_to, xs[cols], o_ours[rows]) for d, (rows, cols, _, _) in zip(deltas, pairs)]

    def ours(calls=calls):
        for f, x, o in calls:
            f(x, o)

    w = 4 if dtype == "float32" else 2
    nbytes = flops = 0
    for rows, cols, _, _ in pairs:
        b_, f_ = linear_model(rows, cols, [rank], 1, w)
        nbytes, flops = nbytes + b_, flops + f_
    impls = {"ours": Impl(ours)}
    if ctx.dram_reader is not None:  # references, not baselines, measured alongside the sweep:
        impls["_dram_read"] = ctx.dram_reader  # DRAM read bandwidth right now (the target's)
        # and a read of as many bytes as the sweep moves (its roof: part of them may stay in L3)
        impls["_same_size_read"] = make_reader(np.ones(nbytes // 4 // 64 * 64, np.float32), ctx.threads)
    mm, add, mul = np.matmul, np.add, np.multiply
    if dtype == "float32":
        o_n, o_t = outs(), outs()
        naive_calls = [(a, b, xs[cols], o_n[rows]) for rows, cols, a, b in pairs]

        def naive(calls=naive_calls, s=s):
            for a, b, x, o in calls:
                o += s * (b @ (a @ x))

        ys, zs = np.empty(rank, np.float32), {r: np.empty(r, np.float32) for r in (4096, 11008)}
        tuned_calls = [(a, b, xs[cols], o_t[rows], zs[rows]) for rows, cols, a, b in pairs]

        def tuned(calls=tuned_calls, s=s, y=ys):
            for a, b, x, o, z in calls:
                mm(a, x, out=y)
                mul(y, s, out=y)
                mm(b, y, out=z)
                add(o, z, out=o)

        impls["numpy_naive"] = Impl(naive)
        impls["numpy_tuned"] = Impl(tuned)
    if torch is not None:
        xt = {c: torch.from_numpy(v) for c, v in xs.items()}
        ot = {r: torch.from_numpy(v) for r, v in outs().items()}
        tm = torch.matmul
        if dtype == "float32":
            y = torch.empty(rank)
            tcalls = [(torch.from_numpy(a), torch.from_numpy(b), xt[cols], ot[rows]) for rows, cols, a, b in pairs]

            def torch_fn(calls=tcalls, s=s, y=y, tm=tm):
                for a, b, x, o in calls:
                    tm(a, x, out=y)
                    o.addmv_(b, y, alpha=s)
        else:
            hd = _half_torch(torch, dtype)
            xh = {c: torch.empty(c, dtype=hd) for c in xs}
            y = torch.empty(rank, dtype=hd)
            zh = {r: torch.empty(r, dtype=hd) for r in ot}
            tcalls = [(torch.from_numpy(a).to(hd), torch.from_numpy(b).to(hd), xh[cols], ot[rows], zh[rows])
                      for rows, cols, a, b in pairs]
            pairs_x = [(xh[c], xt[c]) for c in xs]

            def torch_fn(calls=tcalls, s=s, y=y, tm=tm, pairs_x=pairs_x):
                for h, f in pairs_x:  # the two activations, converted once per token
                    h.copy_(f)
                for a, b, x, o, z in calls:
                    tm(a, x, out=y)
                    tm(b, y, out=z)
                    o.add_(z, alpha=s)
        impls["torch"] = Impl(torch_fn)

    def ours_once():  # the first layer's seven projections, into one concatenated output
        res = []
        for d, (rows, cols, _, _) in list(zip(deltas, pairs))[:7]:
            o = np.zeros(rows, np.float32)
            d.add_to(xs[cols], o)
            res.append(o)
        return np.concatenate(res)

    def ref_once():
        return np.concatenate([s * (b.astype(np.float64) @ (a.astype(np.float64) @ xs[cols]))
                               for rows, cols, a, b in pairs[:7]])

    return Built(impls, nbytes, flops, (ours_once, ref_once, _TOL[dtype]))


def build_bank(ctx, n_adapters, rows, cols, rank, batch):
    """Mixed batch: position b gets adapter ids[b] (-1: none), vs grouping and gather+einsum."""
    lora, torch = ctx.lora, ctx.torch
    if not hasattr(lora, "LoraBank"):
        raise Skip("lora.LoraBank not in this build yet (issue 6)")
    rng = ctx.rng
    pairs = [_pair(rng, rows, cols, rank) for _ in range(n_adapters)]
    deltas = [_make_delta(lora, a, b, "float32", rank) for a, b in pairs]
    s = _scale_of(deltas[0], rank)
    bank = lora.LoraBank(deltas)
    ids = rng.integers(-1, n_adapters, size=batch, dtype=np.int64)
    x = _rand(rng, (batch, cols), 1.0)

    def zeros():
        return np.zeros((batch, rows), np.float32)

    impls = {"ours": Impl(bank.add_batch_to, x, zeros(), ids),
             "single": Impl(deltas[0].add_batch_to, x, zeros())}

    def numpy_group(x=x, o=zeros(), ids=ids, pairs=pairs, s=s):
        for u in np.unique(ids):
            if u < 0:
                continue
            idx = np.flatnonzero(ids == u)
            a, b = pairs[u]
            o[idx] += s * ((x[idx] @ a.T) @ b.T)

    impls["numpy_group"] = Impl(numpy_group)
    if torch is not None:
        # vLLM's CPU LoRA path (lora/ops/torch_ops): gather each token's adapter, then einsum;
        # slot n_adapters is all zeros and stands for -1.
        a_all = torch.stack([torch.from_numpy(a) for a, _ in pairs] + [torch.zeros(rank, cols)])
        b_all = torch.stack([torch.from_numpy(b) for _, b in pairs] + [torch.zeros(rows, rank)])
        ids_t, x_t = torch.from_numpy(ids), torch.from_numpy(x)

        def gather_einsum(x=x_t, o=torch.from_numpy(zeros()), ids=ids_t, a_all=a_all, b_all=b_all, s=s):
            slot = torch.where(ids < 0, n_adapters, ids)
            y = torch.einsum("bc,brc->br", x, a_all[slot])
            o.add_(torch.einsum("br,bor->bo", y, b_all[slot]), alpha=s)

        tp = [(torch.from_numpy(a).T, torch.from_numpy(b).T) for a, b in pairs]

        def torch_group(x=x_t, o=torch.from_numpy(zeros()), ids=ids_t, tp=tp, s=s):
            # PEFT's mixed-batch forward: one sub-batch per adapter
            for u in torch.unique(ids).tolist():
                if u < 0:
                    continue
                idx = torch.nonzero(ids == u).squeeze(1)
                at, bt = tp[u]
                o.index_add_(0, idx, (x[idx] @ at) @ bt, alpha=s)

        impls["gather_einsum"] = Impl(gather_einsum)
        impls["torch_group"] = Impl(torch_group)
    else:
        a_all = np.stack([a for a, _ in pairs] + [np.zeros((rank, cols), np.float32)])
        b_all = np.stack([b for _, b in pairs] + [np.zeros((rows, rank), np.float32)])

        def gather_einsum(x=x, o=zeros(), ids=ids, a_all=a_all, b_all=b_all, s=s):
            slot = np.where(ids < 0, n_adapters, ids)
            y = np.einsum("bc,brc->br", x, a_all[slot])
            o += s * np.einsum("br,bor->bo", y, b_all[slot])

        impls["gather_einsum"] = Impl(gather_einsum)

    def ours_once():
        o = zeros()
        bank.add_batch_to(x, o, ids)
        return o

    def ref_once():
        o = np.zeros((batch, rows), np.float64)
        for i, u in enumerate(ids):
            if u >= 0:
                a, b = pairs[u]
                o[i] = s * (b.astype(np.float64) @ (a.astype(np.float64) @ x[i]))
        return o

    used = [u for u in np.unique(ids) if u >= 0]
    m = int(np.count_nonzero(ids >= 0))
    nbytes = len(used) * rank * (rows + cols) * 4 + m * (cols * 4 + rows * 8) + batch * 8
    return Built(impls, nbytes, 2 * m * rank * (rows + cols), (ours_once, ref_once, _TOL["float32"]))


def workloads(quick, sweep_layers):
    W = []

    def add(name, group, dtype, build, key=""):
        W.append(Workload(name, group, dtype, build, key))

    dec = [(4096, 4096, 8), (4096, 4096, 16), (4096, 4096, 64), (11008, 4096, 16), (4096, 11008, 16)]
    pre = [1, 8, 32, 128, 512]
    for dtype in ("float32", "float16", "bfloat16"):
        for rows, cols, r in dec:
            key = f"decode {rows}x{cols} r{r}"
            add(key, "decode", dtype, lambda c, a=(rows, cols, [r], None, dtype): build_linear(c, *a), key)
        for n in pre:
            key = f"prefill b{n} 4096x4096 r16"
            add(key, "prefill", dtype, lambda c, a=(4096, 4096, [16], n, dtype): build_linear(c, *a), key)
        if dtype == "float32":
            for n in (1, 512):
                add(f"gather n{n} 32000x4096 r16", "gather", dtype, lambda c, n=n: build_gather(c, 32000, 4096, 16, n))
            add("stack 4x r16 b1 4096x4096", "stack", dtype, lambda c: build_linear(c, 4096, 4096, [16] * 4, None, "float32"))
            add("stack 4x r16 b128 4096x4096", "stack", dtype,
                lambda c: build_linear(c, 4096, 4096, [16] * 4, 128, "float32"))
        key = f"sweep llama2-7b {sweep_layers}L r16"
        add(key, "sweep", dtype, lambda c, d=dtype: build_sweep(c, sweep_layers, 16, d), key)
    for n in (64, 512):
        add(f"bank 8x r16 b{n} 4096x4096", "bank", "float32", lambda c, n=n: build_bank(c, 8, 4096, 4096, 16, n))
    return W


# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    lora: object
    torch: object
    rng: object
    dram_reader: object = None  # Impl reading the DRAM-sized buffer once (or None)
    threads: int = 1
    cache: dict = field(default_factory=dict)


class Progress:
    """One status line on stderr: rewritten in place on a terminal, one line per workload otherwise."""

    def __init__(self, total, enabled=True):
        self.total, self.i, self.t0 = total, 0, time.monotonic()
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.width = 0

    def step(self, name):
        self.i += 1
        self.name = name
        if self.enabled and not self.tty:
            print(f"[{self.i:2d}/{self.total}] {time.monotonic() - self.t0:5.0f}s  {name}", file=sys.stderr, flush=True)
        self.status(name)

    def status(self, text):
        if not self.tty:
            return
        line = f"[{self.i:2d}/{self.total}] {time.monotonic() - self.t0:5.0f}s  {text}"[:120]
        sys.stderr.write("\r" + line.ljust(self.width))
        sys.stderr.flush()
        self.width = len(line)

    def done(self):
        if self.tty:
            sys.stderr.write("\r" + " " * self.width + "\r")
        if self.enabled:
            print(f"bench: {self.total} workloads in {time.monotonic() - self.t0:.0f}s", file=sys.stderr)


def rel_err(ours, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(ours, np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def run_workload(wl, ctx, cfg, progress, monitor=None):
    built = wl.build(ctx)
    ours_once, ref_once, tol = built.check
    err = rel_err(ours_once(), ref_once())
    res = {"bytes": built.bytes, "flops": built.flops, "check_rel_err": err}
    if not err <= tol:
        raise AssertionError(f"result differs from the float64 reference: relative error {err:.2e} > {tol:.0e}")
    samples, res["others_cpu"] = measure(built.impls, cfg, progress.status, wl.name, monitor)
    res["impls"] = {name: {**summarize(v), "calls_per_sample": built.impls[name].k} for name, v in samples.items()}
    for name, impl in built.impls.items():
        if getattr(impl, "keep", None) is not None:  # a read reference: record its size
            res["impls"][name]["bytes"] = impl.keep.nbytes
    return res


def analyse(wl, res, bw, peak, threads, caches, by_key):
    """GB/s, GFLOP/s, roofline and speedups of one finished workload (in place)."""
    t = res["impls"]["ours"]["median_s"]
    res["gb_per_s"] = res["bytes"] / t / 1e9
    res["gflop_per_s"] = res["flops"] / t / 1e9
    level = level_for(res["bytes"], threads, caches)
    res["level"] = level
    if "_dram_read" in res["impls"]:
        r = res["impls"]["_dram_read"]
        res["dram_now_bytes_per_s"] = r["bytes"] / r["median_s"]
    if "_same_size_read" in res["impls"]:
        r = res["impls"]["_same_size_read"]
        res["same_size_read_bytes_per_s"] = r["bytes"] / r["median_s"]
    if bw:
        level_bw = bw[level]["bytes_per_s"]
        if "same_size_read_bytes_per_s" in res:  # the sweep: a read of its own size, alongside
            level_bw = res["same_size_read_bytes_per_s"]
        bound = res["bytes"] / level_bw
        binds = "memory"
        if peak and res["flops"] / peak > bound:
            bound, binds = res["flops"] / peak, "compute"
        res["roof_time_s"], res["roof_binds"] = bound, binds
        res["roof_pct"] = 100.0 * bound / t
    sp = {}
    for name, r in res["impls"].items():
        if name != "ours" and not name.startswith("_"):
            sp[name] = r["median_s"] / t
    twin = by_key.get(wl.key) if wl.dtype != "float32" else None
    if twin is not None and "impls" in twin.result:
        for name in ("numpy_naive", "numpy_tuned", "torch"):
            if name in twin.result["impls"]:
                sp[name + "_f32"] = twin.result["impls"][name]["median_s"] / t
        sp["ours_f32"] = twin.result["impls"]["ours"]["median_s"] / t
    res["speedup"] = sp


# --------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------


def targets(W, bw):
    """(description, measured, threshold, status, detail) rows of the issues' speed targets."""
    by = {(w.group, w.dtype, w.name): w for w in W}
    rows = []

    def get(group, dtype, name):
        w = by.get((group, dtype, name))
        return w.result if w is not None and "speedup" in w.result else None

    def row(desc, value, thr, detail="", op=">="):
        if value is None:
            rows.append((desc, None, (op, thr), "SKIP", detail or "not measured"))
        else:
            ok = value >= thr if op == ">=" else value <= thr
            rows.append((desc, value, (op, thr), "PASS" if ok else "MISS", detail))

    for w in W:
        if w.group == "decode" and w.dtype == "float32":
            r = get("decode", "float32", w.name)
            row(f"{w.name} f32 vs NumPy tuned", r and r["speedup"].get("numpy_tuned"), 2.0)
    for n in (128, 512):
        r = get("prefill", "float32", f"prefill b{n} 4096x4096 r16")
        row(f"prefill b{n} f32 vs NumPy tuned", r and r["speedup"].get("numpy_tuned"), 1.5)
    r = get("gather", "float32", "gather n512 32000x4096 r16")
    row("gather n512 vs NumPy naive", r and r["speedup"].get("numpy_naive"), 5.0)
    sweeps = {w.dtype: w for w in W if w.group == "sweep"}
    for dt in ("float32", "bfloat16"):
        w = sweeps.get(dt)
        r = w.result if w is not None and "speedup" in w.result else None
        val, detail = None, ""
        if r and bw:
            # DRAM bandwidth measured interleaved with the sweep (same minutes, same neighbours),
            # else the start-up figure
            dram = r.get("dram_now_bytes_per_s", bw["DRAM"]["bytes_per_s"]) / 1e9
            val = r["gb_per_s"] / dram
            detail = (f"{r['gb_per_s']:.1f} of {dram:.1f} GB/s DRAM read bandwidth measured alongside "
                      f"(at start-up: {bw['DRAM']['bytes_per_s'] / 1e9:.1f}")
            if "same_size_read_bytes_per_s" in r:
                detail += f"; a read of the sweep's {fmt_bytes(r['bytes'])}: " \
                          f"{r['same_size_read_bytes_per_s'] / 1e9:.1f} GB/s"
            detail += ")"
        row(f"sweep {dt} vs DRAM bandwidth", val, 0.8, detail=detail)
    w = sweeps.get("bfloat16")
    r = w.result if w is not None and "speedup" in w.result else None
    row("sweep bf16 vs sweep f32", r and r["speedup"].get("ours_f32"), 1.7)
    r = get("decode", "bfloat16", "decode 4096x4096 r16")
    row("decode 4096x4096 r16 bf16 vs f32", r and r["speedup"].get("ours_f32"), 1.5)
    row("decode 4096x4096 r16 bf16 vs NumPy tuned f32", r and r["speedup"].get("numpy_tuned_f32"), 3.0)
    for n in (64, 512):
        r = get("bank", "float32", f"bank 8x r16 b{n} 4096x4096")
        best = None
        if r:
            cands = {k: v for k, v in r["speedup"].items() if k in ("numpy_group", "gather_einsum")}
            if cands:
                k = min(cands, key=cands.get)
                best = (cands[k], k)
        row(f"bank b{n} vs best of NumPy grouping / gather+einsum", best and best[0], 3.0,
            detail=best and f"best baseline: {best[1]}")
        single = r and r["speedup"].get("single")  # single time / bank time
        row(f"bank b{n} time / single-adapter add_batch_to time", single and 1 / single, 1.3, op="<=")
    # no workload slower than PyTorch CPU: every torch-like baseline, every row
    worst, misses, n = None, [], 0
    for w in W:
        for k, v in w.result.get("speedup", {}).items():
            if k in ("torch", "torch_f32", "torch_group") or (k == "gather_einsum" and w.result.get("torch_used")):
                n += 1
                if worst is None or v < worst[0]:
                    worst = (v, f"{w.name} {w.dtype} vs {k}")
                if v < 1.0:
                    misses.append(f"{w.name} {w.dtype} vs {k}: {v:.2f}x")
    detail = (worst and f"worst: {worst[1]}") or ""
    if misses:
        detail = f"{len(misses)} slower: " + "; ".join(misses[:6]) + ("; ..." if len(misses) > 6 else "")
    row(f"no workload slower than PyTorch ({n} comparisons)", worst and worst[0], 1.0, detail=detail)
    return rows


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------

_DT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_BASE_NAMES = {
    "numpy_naive": "NumPy naive", "numpy_tuned": "NumPy tuned", "torch": "PyTorch",
    "numpy_group": "NumPy grouping", "gather_einsum": "gather+einsum", "torch_group": "PyTorch grouping",
    "single": "single-adapter add_batch_to", "_dram_read": "DRAM read reference",
    "_same_size_read": "same-size read reference", "numpy_naive_f32": "NumPy naive (f32)",
    "numpy_tuned_f32": "NumPy tuned (f32)", "ours_f32": "ours f32", "torch_f32": "PyTorch f32",
}


def header_lines(meta):
    c, k = meta["cpu"], meta["lora"]
    cpu = c["model"]
    if c.get("family_model"):
        cpu += f" ({c['family_model']}" + (f", {c['microarchitecture']}" if c.get("microarchitecture") else "") + ")"
    lines = [
        f"lora-kernels benchmark  {meta['date']}  python {meta['python']}  numpy {meta['numpy']}"
        f"  torch {meta['torch'] or '-'}" + ("  [--quick]" if meta["quick"] else ""),
        f"CPU: {cpu}, {c['logical_cpus']} logical CPUs ({c['usable_cpus']} usable)"
        + (f", {c['mhz']:.0f} MHz nominal" if c.get("mhz") else "")
        + (f", {' '.join(c['simd_flags'])}" if c.get("simd_flags") else ""),
        "caches: L1d {} /core, L2 {} /core, L3 {} ({})".format(
            fmt_bytes(c["caches"]["L1d"]), fmt_bytes(c["caches"]["L2"]), fmt_bytes(c["caches"]["L3"]), c["caches_source"]),
        f"lora {k.get('version')} ({meta['lora_path']}): isa {k.get('isa')} (available: "
        f"{' '.join(k.get('available_isas', []))}), openmp {k.get('openmp')}, threads {k.get('threads')}, "
        f"compiler {k.get('compiler')}",
        f"threads: {meta['threads']} (lora {meta['lora_threads']}, NumPy BLAS {meta['blas_threads']}, "
        f"torch {meta['torch_threads'] or '-'})",
    ]
    for b in meta["blas"]:
        lines.append(f"NumPy BLAS: {b.get('internal_api')} {b.get('version')} ({b.get('architecture', '?')}, "
                     f"{b.get('threading_layer', '?')}), {b.get('num_threads')} threads, "
                     f"{os.path.basename(b.get('filepath', ''))}")
    cleared = meta.get("openblas_cleared")
    lines.append("OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE: "
                 + (f"cleared {cleared} (re-executed)" if cleared else "not set"))
    if meta["bandwidth"]:
        bw = meta["bandwidth"]
        lines.append(f"read bandwidth (C kernel lora_bench_read, {meta['threads']} threads, best of "
                     f"{meta['bw_trials']} at start and at end): " + ", ".join(
                         f"{lv} {bw[lv]['bytes_per_s'] / 1e9:.1f} GB/s ({fmt_bytes(bw[lv]['buffer_bytes'])})"
                         for lv in LEVELS))
    if meta.get("peak_flops"):
        lines.append(f"compute peak (nominal): {meta['threads']} threads x {meta['cpu']['mhz'] / 1e3:.2f} GHz x "
                     f"{_LANES.get(k.get('isa'), 1) * 4} flop/cycle ({k.get('isa')}: lanes x FMA x 2 ports) = "
                     f"{meta['peak_flops'] / 1e9:.0f} GFLOP/s")
    return lines


def _ratio(v):
    if v is None:
        return "-"
    return f"{v:.2f}x" if v < 10 else f"{v:.1f}x" if v < 100 else f"{v:.0f}x"


_BUSY = 0.15  # CPUs' worth used by other processes above which a row is marked


def table_lines(W):
    head = ("workload", "dtype", "ours median", "min-max", "GB/s", "GFLOP/s", "level", "%roof",
            "vs naive", "vs tuned", "vs torch", "other")
    rows = []
    for w in W:
        r = w.result
        if "speedup" not in r:
            status = r.get("skip") and "skipped: " + r["skip"] or "ERROR: " + r.get("error", "?")
            rows.append((w.name, _DT[w.dtype], status))
            continue
        o, sp = r["impls"]["ours"], r["speedup"]
        suffix = "_f32" if w.dtype != "float32" else ""
        other = []
        if w.group == "bank":
            naive, tuned, tor = sp.get("numpy_group"), sp.get("gather_einsum"), sp.get("torch_group")
            other.append("naive=NumPy grouping, tuned=gather+einsum" + (" (torch)" if r.get("torch_used") else " (NumPy)"))
            other.append(f"bank/single {1 / sp['single']:.2f}x")
        else:
            naive, tuned, tor = sp.get("numpy_naive" + suffix), sp.get("numpy_tuned" + suffix), sp.get("torch")
            if suffix:
                other.append(f"vs ours f32 {_ratio(sp.get('ours_f32'))}")
                if "torch_f32" in sp:
                    other.append(f"vs torch f32 {_ratio(sp['torch_f32'])}")
        busy = r.get("others_cpu")
        if busy is not None and busy > _BUSY:
            other.append(f"! others used {busy:.1f} CPU")
        rows.append((w.name, _DT[w.dtype], fmt_time(o["median_s"]), fmt_range(o["min_s"], o["max_s"]),
                     f"{r['gb_per_s']:.1f}", f"{r['gflop_per_s']:.1f}", r["level"],
                     f"{r['roof_pct']:.0f}%" if "roof_pct" in r else "-",
                     _ratio(naive), _ratio(tuned), _ratio(tor), "; ".join(other)))
    widths = [max([len(h)] + [len(x[i]) for x in rows if len(x) == len(head)]) for i, h in enumerate(head)]
    right = {2, 3, 4, 5, 7, 8, 9, 10}

    def fmt(cells):
        if len(cells) != len(head):
            return f"{cells[0]:<{widths[0]}}  {cells[1]:<{widths[1]}}  {cells[2]}"
        return "  ".join((c.rjust(wd) if i in right else c.ljust(wd)) for i, (c, wd) in enumerate(zip(cells, widths))).rstrip()

    lines = [fmt(head), "  ".join("-" * wd for wd in widths)]
    lines += [fmt(x) for x in rows]
    return lines


def baseline_lines(W):
    lines = ["baseline times (median, min-max):"]
    for w in W:
        impls = w.result.get("impls")
        if not impls:
            continue
        cells = [f"{_BASE_NAMES.get(k, k)} {fmt_time(v['median_s'])} ({fmt_range(v['min_s'], v['max_s'])})"
                 for k, v in impls.items() if k != "ours"]
        if cells:
            lines.append(f"  {w.name} {_DT[w.dtype]}: " + "; ".join(cells))
    return lines


def target_lines(rows, quick):
    lines = ["targets" + (" (quick run: indicative only)" if quick else "") + ":"]
    wd = max(len(r[0]) for r in rows)
    for desc, val, (op, thr), status, detail in rows:
        v = "-" if val is None else f"{val:.2f}"
        lines.append(f"  {status:<4}  {desc:<{wd}}  {v:>6} ({op} {thr:g})" + (f"  {detail}" if detail else ""))
    return lines


def _best_torch(w):
    """Speedup over the fastest PyTorch way of doing this row's job (None without torch)."""
    sp = w.result["speedup"]
    keys = ["torch", "torch_f32", "torch_group"]
    if w.result.get("torch_used"):
        keys.append("gather_einsum")
    vals = [sp[k] for k in keys if k in sp]
    return min(vals) if vals else None


def plot(path, W, meta, trows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from matplotlib.patches import Patch

    done = [w for w in W if "speedup" in w.result]
    labels = [f"{w.name} {_DT[w.dtype]}" + (" !" if (w.result.get("others_cpu") or 0) > _BUSY else "")
              for w in done]

    def numpy_ratio(w, kind):  # kind: "tuned" | "naive"
        sp = w.result["speedup"]
        if w.group == "bank":
            return min((sp[k] for k in ("numpy_group", "gather_einsum") if k in sp), default=None) \
                if kind == "tuned" else sp.get("numpy_group")
        return sp.get(f"numpy_{kind}" + ("_f32" if w.dtype != "float32" else ""))

    series = [("vs NumPy tuned (bank: best of grouping, gather+einsum)", lambda w: numpy_ratio(w, "tuned"), "#4c72b0"),
              ("vs NumPy naive (bank: grouping)", lambda w: numpy_ratio(w, "naive"), "#a1c0e8"),
              ("vs the fastest PyTorch variant", _best_torch, "#dd8452")]
    # the issues' targets, drawn on the bar they refer to (series index, threshold)
    tmarks = {}
    for i, w in enumerate(done):
        if w.group == "decode" and w.dtype == "float32":
            tmarks[i] = (0, 2.0)
        elif w.group == "prefill" and w.dtype == "float32" and w.name.split()[1] in ("b128", "b512"):
            tmarks[i] = (0, 1.5)
        elif w.name.startswith("gather n512"):
            tmarks[i] = (1, 5.0)
        elif w.group == "decode" and w.dtype == "bfloat16" and "4096x4096 r16" in w.name:
            tmarks[i] = (0, 3.0)
        elif w.group == "bank":
            tmarks[i] = (0, 3.0)

    n = len(done)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 0.34 * n + 2.8), sharey=True,
                                  gridspec_kw={"width_ratios": [2.2, 1]})
    y = np.arange(n)
    h = 0.27
    for j, (lab, fn, col) in enumerate(series):
        pts = [(yy + (j - 1) * h, fn(w)) for yy, w in zip(y, done)]
        pts = [(yy, v) for yy, v in pts if v]
        ax.barh([p[0] for p in pts], [p[1] for p in pts], height=h, color=col, label=lab)
    for i, (j, thr) in tmarks.items():
        off = (j - 1) * h
        ax.plot([thr, thr], [i + off - h / 2, i + off + h / 2], color="crimson", lw=2.5)
    ax.plot([], [], color="crimson", lw=2.5, label="target (issues 3, 5, 6)")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ticks = [t for t in (0.01, 0.03, 0.1, 0.3, 0.5, 1, 1.5, 2, 3, 5, 10, 20, 50, 100, 300, 1000) if lo <= t <= hi]
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup of lora (x, log scale; right of 1 = lora faster)")
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, fontsize=8, frameon=False)
    ax.grid(axis="x", which="both", alpha=0.3)
    colors = {"L1": "#55a868", "L2": "#64b5cd", "L3": "#8172b3", "DRAM": "#c44e52"}
    ax2.barh(y, [w.result.get("roof_pct", 0) for w in done], color=[colors[w.result["level"]] for w in done])
    handles = [Patch(color=c, label=f"working set in {lv}") for lv, c in colors.items()]
    handles.append(ax2.axvline(80, color="crimson", lw=1, ls="--", label="80%"))
    ax2.axvline(100, color="black", lw=0.8)
    ax2.set_xlabel("% of roofline")
    ax2.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=3, fontsize=8, frameon=False)
    ax2.grid(axis="x", alpha=0.3)
    c, k = meta["cpu"], meta["lora"]
    fig.suptitle(f"lora-kernels {k.get('version')} ({k.get('isa')}, {meta['threads']} threads) on {c['model']}"
                 + (f" [{c['microarchitecture']}]" if c.get("microarchitecture") else "")
                 + f", {c['usable_cpus']} CPUs; NumPy {meta['numpy']} "
                 + (f"({meta['blas'][0].get('internal_api')} {meta['blas'][0].get('architecture')})" if meta["blas"] else "")
                 + (f", torch {meta['torch']}" if meta["torch"] else "") + (" [quick]" if meta["quick"] else ""),
                 fontsize=10)
    fig.text(0.01, 0.005, "half-precision rows (f16, bf16) are compared with NumPy float32 and with the faster of "
             "torch in that dtype / torch float32.  roofline: bytes / measured read bandwidth of the level the "
             "working set lives in, or flops / nominal peak.  ! = other processes were using the CPUs.",
             fontsize=7.5)
    fig.tight_layout(rect=(0, 0.015, 1, 0.99))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every code path, fewer repeats (< 60 s; CI)")
    p.add_argument("--threads", type=int, default=None, help="threads for lora, NumPy's BLAS and torch "
                   "(default: the CPUs this process may use)")
    p.add_argument("--json", metavar="PATH", help="write every number to PATH")
    p.add_argument("--plot", metavar="PATH", help="write a picture (PNG/SVG/PDF, by extension) to PATH")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    p.add_argument("--only", metavar="TEXT", action="append",
                   help="run only workloads whose name or group contains TEXT (repeatable)")
    p.add_argument("--rounds", type=int, help="rounds over the implementations (default 5; quick 1)")
    p.add_argument("--samples", type=int, help="samples per implementation and round (default 5; quick 3)")
    p.add_argument("--min-sample-ms", type=float, help="shortest sample (default 1 ms; quick 0.3 ms)")
    p.add_argument("--settle-ms", type=float, help="idle time before each timed block (default 200; quick 150)")
    p.add_argument("--sweep-layers", type=int, help="layers of the model sweep (default 32; quick 8)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="on a shared machine: before each workload wait up to S seconds for other "
                   "processes to go idle, and measure a timed block again (up to 3 times, after "
                   "waiting up to S seconds) when they were busy during it")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    quick = args.quick
    cpu = cpu_info()
    threads = args.threads or cpu["usable_cpus"] or 1
    cfg = TimingConfig(
        min_sample_s=(args.min_sample_ms or (0.3 if quick else 1.0)) * 1e-3,
        samples=args.samples or (3 if quick else 5),
        rounds=args.rounds or (1 if quick else 5),
        impl_budget_s=0.15 if quick else 0.6,
        settle_s=(args.settle_ms if args.settle_ms is not None else 150 if quick else 200) * 1e-3,
        quiet_wait_s=args.wait_quiet,
    )
    sweep_layers = args.sweep_layers or (8 if quick else 32)
    notes = []

    lora = import_lora()
    torch, why = import_torch(args.no_torch)
    if why:
        notes.append(why)

    from threadpoolctl import threadpool_info, threadpool_limits

    limiter = threadpool_limits(limits=threads)  # BLAS and OpenMP pools, for the whole run
    lora.set_num_threads(threads)
    if torch is not None:
        torch.set_num_threads(threads)
    blas = [d for d in threadpool_info() if d.get("user_api") == "blas" and "numpy" in d.get("filepath", "")]
    blas = blas or [d for d in threadpool_info() if d.get("user_api") == "blas"]
    kinfo = dict(lora.kernel_info())
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None, "quick": quick, "cpu": cpu,
        "lora": kinfo, "lora_path": os.path.dirname(lora.__file__), "threads": threads,
        "lora_threads": lora.get_num_threads(), "blas_threads": ", ".join(str(b.get("num_threads")) for b in blas) or "-",
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "blas": blas, "openblas_cleared": os.environ.get(_REEXEC_NOTE),
        "timing": cfg.__dict__, "sweep_layers": sweep_layers, "bw_trials": 3 if quick else 6,
    }
    if meta["lora_threads"] != threads:
        notes.append(f"lora runs {meta['lora_threads']} threads, not the {threads} asked for "
                     f"(kernel_info: openmp {kinfo.get('openmp')})")

    W = workloads(quick, sweep_layers)
    if args.only:
        W = [w for w in W if any(t in f"{w.name} {w.group} {w.dtype}" for t in args.only)]
    progress = Progress(len(W) + 2, enabled=not args.no_progress)
    failures = 0

    monitor = CpuMonitor()
    time.sleep(0.5)
    busy = monitor.others()
    meta["others_cpu_at_start"] = busy
    if busy is not None and busy > 0.2:
        notes.append(f"the machine was busy at start: other processes used {busy:.1f} CPUs; "
                     "multi-threaded timings will be noisy (rows marked !)")
    def bandwidth(when):
        progress.step(f"bandwidth ({when})")
        if args.wait_quiet:
            wait_quiet(monitor, args.wait_quiet, progress.status)
        try:
            return measure_bandwidth(threads, cpu["caches"], meta["bw_trials"], progress.status, monitor,
                                     args.wait_quiet)
        except Exception as e:
            notes.append(f"ERROR: bandwidth measurement ({when}) failed ({type(e).__name__}: {e})")
            traceback.print_exc()
            return None, None

    bw, dram_reader = bandwidth("start")
    ctx = Ctx(lora, torch, np.random.default_rng(0), dram_reader, threads)
    for w in W:
        progress.step(f"{w.name} {_DT[w.dtype]}")
        try:
            if args.wait_quiet:
                wait_quiet(monitor, args.wait_quiet, progress.status)
            w.result = run_workload(w, ctx, cfg, progress, monitor)
            w.result["torch_used"] = torch is not None
        except Skip as e:
            w.result = {"skip": str(e)}
        except Exception as e:
            failures += 1
            w.result = {"error": f"{type(e).__name__}: {e}"}
            print(f"\nbench: {w.name} {w.dtype} failed:", file=sys.stderr)
            traceback.print_exc()
        if w.group == "sweep" and w.dtype == "bfloat16":
            ctx.cache.clear()  # the last user of the sweep's source arrays
    ctx.dram_reader = dram_reader = None
    # measured again at the end: noise only ever lowers a bandwidth, so keep the better figure
    bw_end, _ = bandwidth("end")
    if bw and bw_end:
        for lv in bw:
            if bw_end[lv]["bytes_per_s"] > bw[lv]["bytes_per_s"]:
                bw[lv] = bw_end[lv]
    bw = bw or bw_end
    if bw is None:
        failures += 1
    meta["bandwidth"] = bw
    meta["peak_flops"] = peak_flops(threads, cpu.get("mhz"), kinfo.get("isa"))
    progress.done()
    limiter.restore_original_limits()
    by_key = {}
    for w in W:
        if "impls" in w.result:
            analyse(w, w.result, bw, meta["peak_flops"], threads, cpu["caches"], by_key)
        if w.dtype == "float32":
            by_key[w.key] = w

    trows = targets(W, bw)
    out = header_lines(meta) + [""] + table_lines(W) + [""]
    out += [
        "columns: ours = end to end through the Python API; GB/s, GFLOP/s from the bytes/flops model (see the",
        "  docstring); level = where the working set lives; %roof = roofline bound / measured median;",
        "  vs X = X's median / ours (> 1: lora is faster). Half-precision rows: naive/tuned are the NumPy float32",
        "  baselines of the same shape; torch stores the adapters in the same half dtype; torch f32 is the float32",
        "  torch row (a user who upcasts the adapters once).",
    ]
    out += [""] + baseline_lines(W) + [""] + target_lines(trows, quick)
    skips = [f"{w.name} {_DT[w.dtype]}: {w.result['skip']}" for w in W if "skip" in w.result]
    if notes or skips:
        out += ["", "notes:"] + [f"  {n}" for n in notes + skips]
    print("\n".join(out))

    if args.json:
        doc = {"meta": meta, "notes": notes, "workloads": [
            {"name": w.name, "group": w.group, "dtype": w.dtype, **w.result} for w in W],
            "targets": [{"target": d, "value": v, "op": t[0], "threshold": t[1], "status": s, "detail": det}
                        for d, v, t, s, det in trows]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    if args.plot:
        try:
            plot(args.plot, W, meta, trows)
        except Exception:
            failures += 1
            print("bench: plot failed:", file=sys.stderr)
            traceback.print_exc()
    if failures:
        print(f"bench: {failures} failure(s)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
