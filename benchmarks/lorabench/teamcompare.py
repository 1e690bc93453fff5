"""``--team-compare``: the evidence for a CPU table row's team floor (``team_floor_log2`` in
``csrc/isa.c``), measured here.

float32 and bfloat16 decodes whose bytes fit one core's L2 (the calls the plain floor decides;
calls past the L2 have their own, lower floor) are timed on one thread and on two, the thread
count set before each timed block (and the floor lowered below every row for the run,
``lora_team_set_min_work``, so that two threads really open a team) and the rounds alternating
the two, so that a drift in the machine's load falls on both.  The thread count never changes the bits, only the time.  The
report: per row its multiply-adds, bytes, both medians and two threads' median over one
thread's, and the floor the run suggests: the lowest power of two from which every row of at
least that work ran at most ``PAYOFF`` of one thread's time on two (the team policy's own
pay-off line), ``0`` (the default floor, 2^18) where that is the default or higher.
"""

from __future__ import annotations

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
    import ml_dtypes

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
            st = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
            d = lora.LoraDelta((rng.standard_normal((rank, cols)) * 0.02).astype(st),
                               (rng.standard_normal((rows, rank)) * 0.02).astype(st))
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
    finally:
        lora.set_num_threads(default_threads)
        lib.lora_team_set_min_work(0)
        lib.lora_team_reset()
    progress.done()
    p = suggest(found)
    kinfo = lora.kernel_info()
    cpu = kinfo["cpu"]
    print("\n".join([
        report.cpu_line(c),
        f"cpuid: {cpu['vendor']} family {cpu['family']} model {cpu['model']} (table row: "
        f"{cpu['name'] or 'none'}); one core's L2: {l2 >> 10} KiB; {kinfo['thread_policy']}",
        f"load from other processes over the run: {run_monitor.others() or 0:.2f} CPUs", "",
        f"{'row':<36} work   bytes     1 thread  2 threads  2t/1t   teams  lost  load",
        *body, "",
        f"2t/1t: two threads' median over one thread's, rounds alternating; a team pays at <= {PAYOFF}; "
        "teams / lost: team calls of the two-thread blocks and those the policy judged lost (two in a "
        "row start a back-off to one thread: a block that ends backed off makes the row noisy)",
        f"suggested team_floor_log2 for this core's csrc/isa.c row: {p}"
        + (f" (a team from 2^{p} multiply-adds)" if p else " (the default floor, 2^18)")
        + (" (noisy: measure again with --wait-quiet)" if noisy else "")]))
    return 0
