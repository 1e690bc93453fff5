"""``--team-compare``: the evidence for a CPU table row's team floor (``team_floor_log2`` in
``csrc/isa.c``), measured here.

float32 and bfloat16 decodes whose bytes fit one core's L2 (the calls the plain floor decides;
calls past the L2 have their own, lower floor) are timed on one thread and on two, the thread
count set before each timed block (and the floor lowered below every row for the run,
``lora_team_set_min_work``, so that two threads really open a team) and the rounds alternating
the two, so that a drift in the machine's load falls on both. The thread count never changes the
bits, only the time. The report: per row its multiply-adds, bytes, both medians and two threads'
median over one thread's, and the floor the run suggests: the lowest power of two from which
every row of at least that work ran at most ``PAYOFF`` of one thread's time on two (the team
policy's own pay-off line), ``0`` (the default floor, 2^18) where that is the default or higher.
Then a cold sweep (``cold_sweep``): a model's decode step past the last-level cache at the
floors 2^17 and 2^18, which a row's floor should not slow down either.
"""

from __future__ import annotations

import time

import numpy as np

from . import machine, report
from .timing import Impl, TimingConfig, measure, summarize

# (rows, cols, rank, storage): 2^16 and 2^17 multiply-adds, up to 1 MiB with x and out
ROWS = ((4096, 4096, 8, "float32"), (4096, 4096, 16, "float32"), (4096, 4096, 16, "bfloat16"),
        (4096, 11008, 16, "float32"), (11008, 4096, 16, "bfloat16"), (4096, 4096, 32, "float32"))
PAYOFF = 0.9
DEFAULT_LOG2 = 18


def nbytes(rows, cols, rank, dtype):
    return rank * (rows + cols) * (4 if dtype == "float32" else 2) + 4 * (rows + cols)


def suggest(results):
    """The floor's log2 the rows support, 0 for the default: `results` is a list of
    (work, two threads' median / one thread's)."""
    for p in sorted({work.bit_length() - 1 for work, _ in results}):
        if p >= DEFAULT_LOG2:
            break
        above = [ratio for work, ratio in results if work >= 1 << p]
        if above and all(ratio <= PAYOFF for ratio in above):
            return p
    return 0


def cold_sweep(lora, lib, cpu, rounds, dtype):
    """One decode per projection of Llama-2-7B-shaped rank-16 adapters, sized past the
    last-level cache as the main run's sweep (``workloads.size_sweep``), so every call reads its
    factors from memory (the case of a model's decode step): the median pass with the floor at
    2^17 and at the default, rounds alternating (the caller restores the floor).  Returns (MiB,
    seconds at 2^17, at 2^18)."""
    from .workloads.sweep import LLAMA2_7B, SWEEP_RANK, size_sweep, sweep_layer_bytes

    layers, _ = size_sweep(cpu["llc"]["bytes"], cpu["mem_available_bytes"])
    rng = np.random.default_rng(1)
    calls = []
    for _ in range(layers):
        for _, rows, cols in LLAMA2_7B:
            a = rng.standard_normal((SWEEP_RANK, cols), np.float32) * 0.02
            b = rng.standard_normal((rows, SWEEP_RANK), np.float32) * 0.02
            x, out = np.ones(cols, np.float32), np.zeros(rows, np.float32)
            calls.append((lora.LoraDelta(a, b, dtype=dtype), x, out))
    size = layers * sweep_layer_bytes(SWEEP_RANK, 4 if dtype == "float32" else 2)

    def one_pass():
        t = time.perf_counter()
        for d, x, out in calls:
            d.add_to(x, out)
        return time.perf_counter() - t
    times = {17: [], DEFAULT_LOG2: []}
    for _ in range(rounds):
        for p in times:
            lib.lora_team_set_min_work(1 << p)
            lib.lora_team_reset()
            one_pass()  # wakes the team; the next passes find nothing of it left in cache
            times[p].append(min(one_pass() for _ in range(3)))
    return size / 2**20, float(np.median(times[17])), float(np.median(times[DEFAULT_LOG2]))


def _team_stats(lib):
    from lora._lora_cffi import ffi
    calls, lost = ffi.new("int64_t *"), ffi.new("int64_t *")
    lib.lora_team_stats(calls, lost)
    return calls[0], lost[0]


def run(args):
    """``bench.py --team-compare``: measure, print; exit status."""
    lora = machine.import_lora()
    from lora._lora_cffi import lib
    c = machine.cpu_info()
    default_threads = lora.get_num_threads()
    lora.set_num_threads(2)
    two = lora.get_num_threads() >= 2
    lora.set_num_threads(default_threads)
    if not two or (args.threads or 2) < 2:
        print("one thread here (no OpenMP, one usable CPU, --threads 1, or a cap of 1 from "
              "OMP_NUM_THREADS, threadpoolctl or torch.set_num_threads): nothing to compare")
        return 0
    cfg = TimingConfig(min_sample_s=(args.min_sample_ms or 1.0) * 1e-3, samples=args.samples or 5,
                       rounds=args.rounds or 7, impl_budget_s=0.6,
                       settle_s=(args.settle_ms if args.settle_ms is not None else 200) * 1e-3,
                       quiet_wait_s=args.wait_quiet)
    rng = np.random.default_rng(0)
    l2 = lib.lora_team_l2_bytes()
    monitor, run_monitor = machine.CpuMonitor(), machine.CpuMonitor()
    progress = report.Progress(len(ROWS), enabled=not args.no_progress)
    body, found, noisy = [], [], False
    try:
        for rows, cols, rank, dtype in ROWS:
            size = nbytes(rows, cols, rank, dtype)
            label = f"decode {rows}x{cols} r{rank} {dtype}"
            progress.step(label)
            if l2 and size > l2:  # past one core's L2: the lower floor decides it, not this one
                body.append(f"{label:<36} skipped: {size >> 10} KiB, past one core's L2")
                continue
            d = lora.LoraDelta(rng.standard_normal((rank, cols), np.float32) * 0.02,
                               rng.standard_normal((rows, rank), np.float32) * 0.02, dtype=dtype)
            x, out = rng.standard_normal(cols).astype(np.float32), np.zeros(rows, np.float32)
            impls, tally = {}, [0, 0, 0]  # team calls, judged lost, blocks that ended backed off

            def count():  # the block just measured: its team calls, and whether it backed off
                calls, lost = _team_stats(lib)
                tally[0] += calls
                tally[1] += lost
                tally[2] += lib.lora_team_backoff() > 0
            for nt in (1, 2):
                def before(nt=nt):
                    count()
                    lora.set_num_threads(nt)
                    lib.lora_team_set_min_work(1 << 14)  # a team for every row: the candidate
                    lib.lora_team_reset()
                impls[nt] = Impl(d.add_to, x, out, before=before)
            lib.lora_team_reset()
            samples, busy = measure(impls, cfg, progress.status, label, monitor)
            count()
            # the policy's back-off may still have put two-thread calls on one: count it
            teams, lost, backed = tally
            med = {nt: summarize(samples[nt])["median_s"] for nt in impls}
            work = rank * (rows + cols)
            flag = busy is not None and busy > machine.CpuMonitor.BUSY
            backed_off = backed > 0
            noisy |= flag or backed_off
            found.append((work, med[2] / med[1]))
            body.append(f"{label:<36} 2^{work.bit_length() - 1}  {size >> 10:>5} KiB  "
                        f"{report.fmt_time(med[1]):>9}  {report.fmt_time(med[2]):>9}  "
                        f"{med[2] / med[1]:5.2f}  {teams:>6} {lost:>5}  "
                        + ("-" if busy is None else f"{'! ' if flag else ''}others {busy:.2f} CPU")
                        + (f"; ! {backed} blocks backed off to one thread" if backed_off else ""))
        lora.set_num_threads(2)
        sweeps = [(dt, *cold_sweep(lora, lib, c, max(3, cfg.rounds), dt))
                  for dt in ("float32", "bfloat16")]
    finally:
        lora.set_num_threads(default_threads)
        lib.lora_team_set_min_work(0)
        lib.lora_team_reset()
    progress.done()
    p = suggest(found)
    sweep_lines = [f"cold sweep {dt:<8} {mib:5.0f} MiB past the L3: floor 2^17 "
                   f"{t17 * 1e3:.2f} ms, 2^18 {t18 * 1e3:.2f} ms, 2^17/2^18 {t17 / t18:.2f}"
                   for dt, mib, t17, t18 in sweeps]
    kinfo = lora.kernel_info()
    cpu = kinfo["cpu"]
    print("\n".join([
        report.cpu_line(c),
        f"cpuid: {cpu['vendor']} family {cpu['family']} model {cpu['model']} (table row: "
        f"{cpu['name'] or 'none'}); one core's L2: {l2 >> 10} KiB; {kinfo['thread_policy']}",
        f"load from other processes over the run: {run_monitor.others() or 0:.2f} CPUs", "",
        f"{'row':<36} work   bytes     1 thread  2 threads  2t/1t   teams  lost  load",
        *body, *sweep_lines, "",
        "2t/1t: two threads' median over one thread's, rounds alternating; a team pays at <= "
        f"{PAYOFF}; teams / lost: team calls of the two-thread blocks and those the policy judged "
        "lost (two in debt start a back-off to one thread: a block that ends backed off makes "
        "the row noisy)",
        "cold sweep: one decode per projection of Llama-2-7B-shaped rank-16 adapters, a model's "
        "decode step with every factor read from memory, the median pass at each floor",
        f"suggested team_floor_log2 for this core's csrc/isa.c row (the rows above): {p}"
        + (f" (a team from 2^{p} multiply-adds)" if p else " (the default floor, 2^18)")
        + (" (noisy: measure again with --wait-quiet)" if noisy else "")]))
    return 0
