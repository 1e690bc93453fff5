"""The machine: CPU and caches, memory, read bandwidth per level, compute peak, thread pools,
and the load other processes put on the CPUs while we measure."""

from __future__ import annotations

import glob
import math
import os
import platform
import sys
import time

import numpy as np

from .timing import Impl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Intel family-6 model numbers of recent server / client cores (KVM guests often hide the name).
_INTEL_MODELS = {
    85: "Skylake-SP / Cascade Lake", 106: "Ice Lake-SP", 108: "Ice Lake-D", 143: "Sapphire Rapids",
    207: "Emerald Rapids", 173: "Granite Rapids", 151: "Alder Lake", 183: "Raptor Lake",
    140: "Tiger Lake", 126: "Ice Lake",
}
_DEFAULT_CACHES = {"L1d": 32 << 10, "L2": 1 << 20, "L3": 32 << 20}
_SYSCONF_CACHES = {"L1d": "SC_LEVEL1_DCACHE_SIZE", "L2": "SC_LEVEL2_CACHE_SIZE", "L3": "SC_LEVEL3_CACHE_SIZE"}


# --------------------------------------------------------------------------------------------
# imports that may be missing
# --------------------------------------------------------------------------------------------


def import_lora():
    """Prefer an in-place build of this checkout (build_ext --inplace) over an installed copy."""
    if glob.glob(os.path.join(REPO, "lora", "_lora_cffi*")) and REPO not in sys.path:
        sys.path.insert(0, REPO)
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
# CPU, caches, memory
# --------------------------------------------------------------------------------------------


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


def fmt_bytes(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v >= 10 or v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def cache_sizes():
    """Data/unified cache sizes of cpu0 in bytes ({"L1d", "L2", "L3"}), the last level's name, and
    where they came from: sysfs, else getconf (sysconf), else defaults (said so)."""
    caches, source = {}, None
    for idx in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        level, ctype, size = _read(idx + "/level"), _read(idx + "/type"), _read(idx + "/size")
        if level and ctype and size and ctype != "Instruction":
            caches["L1d" if level == "1" else f"L{level}"] = _parse_size(size)
            source = "sysfs"
    if not caches:
        for name, key in _SYSCONF_CACHES.items():
            try:
                v = os.sysconf(key)
            except (ValueError, OSError, AttributeError):
                continue
            if v and v > 0:
                caches[name] = v
                source = "getconf"
    llc = max(caches, key=lambda k: (k != "L1d", k)) if caches else "L3"
    for name, v in _DEFAULT_CACHES.items():
        caches.setdefault(name, v)  # the roofline wants all three (a missing L3: the L2 is the LLC)
    return caches, llc, source or "defaults (not detected)"


def available_memory():
    """Bytes of memory available to a new allocation without swapping (MemAvailable), or None."""
    for line in (_read("/proc/meminfo", "") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_info():
    info = {"model": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["usable_cpus"] = os.cpu_count()
    fields = {}
    for line in _read("/proc/cpuinfo", "").splitlines():
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
    info["caches"], llc, info["caches_source"] = cache_sizes()
    info["llc"] = {"level": llc, "bytes": info["caches"][llc]}
    info["mem_available_bytes"] = available_memory()
    return info


# --------------------------------------------------------------------------------------------
# thread pools
# --------------------------------------------------------------------------------------------


def blas_pools():
    """threadpoolctl's description of NumPy's BLAS (every BLAS pool if none is NumPy's)."""
    from threadpoolctl import threadpool_info

    pools = threadpool_info()
    blas = [d for d in pools if d.get("user_api") == "blas" and "numpy" in d.get("filepath", "")]
    return blas or [d for d in pools if d.get("user_api") == "blas"]


# --------------------------------------------------------------------------------------------
# load from other processes
# --------------------------------------------------------------------------------------------


class CpuMonitor:
    """CPU time other processes (and the hypervisor: steal) took while we measured.

    On a small shared machine a second busy process turns every 2-thread handoff into a wait for
    a scheduler tick (4-8 ms per call instead of 60 µs): such numbers are flagged, not trusted.
    Our own child processes (the start-up timings) count as ours once they have been waited for.
    Linux only (/proc/stat); elsewhere it reports nothing.
    """

    BUSY = 0.15  # CPUs' worth used by other processes above which a measurement is "noisy"

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.ok = os.path.exists("/proc/stat")
        self.mark()

    def _busy(self):
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        return (v[0] + v[1] + v[2] + v[5] + v[6]) / self.hz, (v[7] if len(v) > 7 else 0) / self.hz

    @staticmethod
    def _own():
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def mark(self):
        self.t0 = time.monotonic()
        if self.ok:
            self.busy0, self.steal0 = self._busy()
            self.own0 = self._own()

    def others(self):
        """CPUs' worth (e.g. 0.9 = most of one core) used by others since mark(), incl. steal."""
        if not self.ok:
            return None
        busy, steal = self._busy()
        wall = max(time.monotonic() - self.t0, 1e-3)
        other = (busy - self.busy0) - (self._own() - self.own0) + (steal - self.steal0)
        return max(0.0, other / wall)

    @classmethod
    def quiet_enough(cls, busy):
        return busy is None or busy <= cls.BUSY

    def wait_quiet(self, budget_s, status):
        """Sleep in 0.5 s steps until other processes use < 0.1 CPU, for at most budget_s seconds."""
        end = time.monotonic() + budget_s
        while time.monotonic() < end:
            self.mark()
            time.sleep(0.5)
            busy = self.others()
            if busy is None or busy < 0.1:
                return True
            status(f"waiting for a quiet machine (others use {busy:.1f} CPU)")
        return False


def loadavg():
    """The 1, 5 and 15 minute load averages (runnable threads, ours included), or None."""
    text = _read("/proc/loadavg")
    if text:
        return [float(x) for x in text.split()[:3]]
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


# --------------------------------------------------------------------------------------------
# bandwidth and peak
# --------------------------------------------------------------------------------------------

LEVELS = ("L1", "L2", "L3", "DRAM")
LANES = {"avx512": 16, "avx2": 8, "neon": 4, "scalar": 1}
PEAK_STEPS_START = 1 << 12  # FMA-kernel steps of the first sizing run
PEAK_TRIAL_S = 0.02  # a compute-peak trial lasts at least this long


def bandwidth_buffers(caches, threads):
    """Buffer size (bytes) per level: half the per-core L1d and L2 per thread, a slice of the L3,
    and 4x the L3 (>= 256 MiB, <= 2 GiB) for DRAM."""
    l1, l2, l3 = caches["L1d"], caches["L2"], caches["L3"]
    l3_buf = min(max(l3 // 8, 4 * l2 * threads), l3 // 2)
    dram = min(max(4 * l3, 256 << 20), 2 << 30)
    return {"L1": l1 // 2 * threads, "L2": l2 // 2 * threads, "L3": l3_buf, "DRAM": dram}


def measure_bandwidth(threads, caches, trials, progress, monitor=None, quiet_wait_s=0.0, retries=3):
    """Read bandwidth per level with the extension's C kernel, bytes/s, and the compute peak
    (its FMA kernel, flop/s): the best of `trials` rounds, each round visiting every level and the
    FMA kernel (a noisy second on a shared machine then spoils one trial of each, not all trials
    of one).  With `quiet_wait_s`, a round during which other processes were busy is repeated
    once they are idle.  Returns the figures (the levels, and "peak": flops_per_s and flops per
    trial), a reader of the DRAM-sized buffer (the sweep re-measures DRAM alongside itself) and
    the most CPU others took during a kept round."""
    from lora._lora_cffi import ffi, lib  # the private bench kernels

    read, fma = lib.lora_bench_read, lib.lora_bench_fma
    flops = ffi.new("int64_t *")
    steps = PEAK_STEPS_START
    while True:  # a trial: twice the first run of >= half of PEAK_TRIAL_S, sized on this machine
        t0 = time.perf_counter_ns()
        fma(steps, threads, flops)
        long_enough = (time.perf_counter_ns() - t0) * 1e-9 >= PEAK_TRIAL_S / 2 or steps >= 1 << 40
        steps *= 2
        if long_enough:
            break
    bufs = {}
    for level, nbytes in bandwidth_buffers(caches, threads).items():
        progress(f"bandwidth: allocating {level} buffer ({fmt_bytes(nbytes)})")
        n = (nbytes // 4) // 64 * 64
        buf = np.ones(n, dtype=np.float32)  # written: paged in
        reps = max(1, int(512e6 // (n * 4)))  # >= 512 MB read per trial (>= 1 ms even from L1)
        bufs[level] = (buf, ffi.from_buffer("float[]", buf), n, reps)
    time.sleep(0.2)  # let pools started by the set-up (OpenBLAS spins ~0.1 s) go idle
    best = dict.fromkeys(list(bufs) + ["peak"], math.inf)
    busy_max = None
    for t in range(trials):
        for attempt in range(retries + 1):
            progress(f"bandwidth: trial {t + 1}/{trials}" + (f", retry {attempt}" if attempt else ""))
            if attempt and quiet_wait_s and monitor is not None:
                monitor.wait_quiet(quiet_wait_s, progress)
            if monitor is not None:
                monitor.mark()
            times = {}
            for level, (_, ptr, n, reps) in bufs.items():
                read(ptr, n, 1, threads)  # warm this level
                t0 = time.perf_counter_ns()
                read(ptr, n, reps, threads)
                times[level] = (time.perf_counter_ns() - t0) * 1e-9
            t0 = time.perf_counter_ns()
            fma(steps, threads, flops)
            times["peak"] = (time.perf_counter_ns() - t0) * 1e-9
            busy = monitor.others() if monitor is not None else None
            if monitor is None or not quiet_wait_s or attempt == retries or monitor.quiet_enough(busy):
                break
        if busy is not None:
            busy_max = max(busy_max or 0.0, busy)
        for level, dt in times.items():
            best[level] = min(best[level], dt)
    out = {lv: {"buffer_bytes": n * 4, "reps": reps, "bytes_per_s": n * 4 * reps / best[lv]}
           for lv, (_, _, n, reps) in bufs.items()}
    out["peak"] = {"flops": flops[0], "flops_per_s": flops[0] / best["peak"]}
    return out, make_reader(bufs["DRAM"][0], threads), busy_max


def make_reader(buf, threads):
    """An Impl that reads the float32 array `buf` once with the C read kernel (a reference)."""
    from lora._lora_cffi import ffi, lib

    r = Impl(lib.lora_bench_read, ffi.from_buffer("float[]", buf), buf.size, 1, threads)
    r.keep = buf
    return r


class _Stored:
    """What a deltas reader holds: the deltas (alive while it runs) and the bytes it reads."""

    def __init__(self, deltas, nbytes):
        self.deltas, self.nbytes = deltas, nbytes


def make_deltas_reader(deltas, threads):
    """An Impl that reads the stored factors of `deltas` delta by delta with the C read kernel, as
    their decode calls meet them (a reference: the memory system's share of a cold sweep)."""
    from lora._lora_cffi import ffi, lib

    ptrs = ffi.new("lora_delta *[]", [d._ptr for d in deltas])
    nbytes = ffi.new("int64_t *")
    lib.lora_bench_read_deltas(ptrs, len(deltas), threads, nbytes)
    r = Impl(lib.lora_bench_read_deltas, ptrs, len(deltas), threads, ffi.NULL)
    r.keep = _Stored((deltas, ptrs), nbytes[0])
    return r


def peak_flops(threads, mhz, isa):
    """Nominal peak: threads x GHz x lanes x 2 (FMA) x 2 FMA ports, the figure a spec sheet
    gives.  It is printed beside the measured peak (``measure_bandwidth``'s "peak", which the
    roofline uses): a 512-bit FMA on 256-bit units (Zen 4), one FMA port, or a clock above the
    nominal one each make the two differ."""
    if not mhz:
        return None
    return threads * mhz * 1e6 * LANES.get(isa, 1) * 2 * 2


def level_for(ws_bytes, threads, caches):
    """Where a working set lives: L1/L2 if bytes/threads <= 3/4 of the per-core cache, L3 if
    bytes <= 1/2 of the L3, else DRAM."""
    per_thread = ws_bytes / threads
    if per_thread <= 0.75 * caches["L1d"]:
        return "L1"
    if per_thread <= 0.75 * caches["L2"]:
        return "L2"
    if ws_bytes <= 0.5 * caches["L3"]:
        return "L3"
    return "DRAM"
