"""``--isa-compare``: the evidence for a row of the CPU table in ``csrc/isa.c``, measured here.

A few rows of the main run (decode 4096x4096 r16 in float32 and bfloat16, prefill b128, the bank
row b64) are built once and timed under every ISA path this CPU runs, the path switched
in-process (``lora._runtime.set_isa``) before each timed block, the rounds visiting the paths
in turn so that a drift in the machine's load falls on all of them.  Each row is checked
against float64 under every path first.  The report: per row and path the median and min-max,
each path's median over the widest path's (``avx2/avx512`` > 1: the widest is faster), the
winner by the median, and the table row the run suggests, in ``csrc/isa.c``'s syntax: a path
for the CPU's vendor / family / model when a narrower one wins by the geometric mean of the
rows' medians, else ``FLAGS_`` (the row only names the core), marked ``noisy`` when other
processes used more than ``machine.CpuMonitor.BUSY`` CPUs during a row.
"""

from __future__ import annotations

import math
import time

import numpy as np

from . import machine, report, workloads
from .timing import Impl, TimingConfig, measure, summarize
from .workloads import bank_name, decode_name, prefill_name

ROWS = ((decode_name(4096, 4096, 16), "float32"), (decode_name(4096, 4096, 16), "bfloat16"),
        (prefill_name(128), "float32"), (bank_name(64), "float32"))
DT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _rows():
    """The ROWS workloads of the main run, in ROWS order (the same builders and sizes)."""
    found = {(w.name, w.dtype): w for w in workloads.workloads(sweep_layers=1, startup_runs=1)
             if (w.name, w.dtype) in ROWS}
    return [found[k] for k in ROWS]


def _switched(runtime, isa, impl):
    """A copy of `impl` that runs on path `isa`: switched before each of its blocks."""
    def before():
        runtime.set_isa(isa)
        if impl.before is not None:
            impl.before()
    return Impl(impl.fn, *impl.args, before=before)


def measure_rows(lora, isas, cfg, progress, monitor, threads):
    """{row label: {"paths": {isa: summary}, "others_cpu": float | None, "check": {isa: rel err}}};
    `progress` is a ``report.Progress``."""
    from lora import _runtime

    ctx = workloads.Ctx(lora, None, np.random.default_rng(0), None, threads)
    default = _runtime.isa()
    out = {}
    try:
        for w in _rows():
            label = f"{w.name} {DT[w.dtype]}"
            progress.step(label)
            built = w.build(ctx)
            ours_once, ref_once, tol = built.check
            ref, check = ref_once(), {}
            for isa in isas:
                _runtime.set_isa(isa)
                check[isa] = workloads.rel_err(ours_once(), ref)
                if not check[isa] <= tol:
                    raise AssertionError(f"{label} on {isa}: relative error {check[isa]:.2e} > {tol:.0e}")
            impls = {isa: _switched(_runtime, isa, built.impls["ours"]) for isa in isas}
            samples, busy = measure(impls, cfg, progress.status, label, monitor)
            out[label] = {"paths": {isa: summarize(samples[isa]) for isa in isas}, "others_cpu": busy,
                          "check": check}
    finally:
        _runtime.set_isa(default)
    return out


def _geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def fastest(row, isas):
    """The path with the lowest median on one row."""
    return min(isas, key=lambda isa: row["paths"][isa]["median_s"])


def suggestion(results, isas, widest):
    """(winner, {isa: geometric mean of its medians over the widest path's}) over every row."""
    rel = {isa: _geomean([r["paths"][isa]["median_s"] / r["paths"][widest]["median_s"]
                          for r in results.values()]) for isa in isas}
    return min(isas, key=lambda isa: (rel[isa], isa != widest)), rel


def table_row(cpu, name, isa, widest, rel, wins, date, noisy):
    """The CPU table row this run suggests, in csrc/isa.c's syntax (one line); `wins`: (rows
    where `isa` was fastest, rows)."""
    path = "FLAGS_" if isa == widest else f"LORA_ISA_{isa.upper()}"
    margin = ", ".join(f"{o} {rel[o] / rel[isa]:.2f}x its time" for o in rel if o != isa)
    evidence = (f"bench.py --isa-compare {date}: {isa} fastest on {wins[0]}/{wins[1]} rows, {margin} "
                "(geomean of medians); docs/performance.md 'ISA paths by CPU'")
    line = (f'{{"{cpu["vendor"]}", {cpu["family"]}, {cpu["model"]}, {cpu["model"]}, {path}, 0, '
            f'LORA_Q8_0_WIDEN_SHUFFLE, "{name}", '
            f'"{evidence}"}},')
    return line + ("  /* noisy: measure again on a quiet machine (--wait-quiet) */" if noisy else "")


def report_lines(cpu_text, kinfo, results, isas, date, load):
    """The printed report: CPU and lora lines, one line per row, and the suggested table row."""
    widest = isas[-1]
    others = [isa for isa in isas if isa != widest]
    head = ["row"] + [f"{isa} median" for isa in isas] + [f"{isa} min-max" for isa in isas] \
        + [f"{isa}/{widest}" for isa in others] + ["fastest", "load"]
    body, noisy = [], False
    for label, r in results.items():
        p = r["paths"]
        busy = r["others_cpu"]
        flag = busy is not None and busy > machine.CpuMonitor.BUSY
        noisy |= flag
        body.append([label] + [report.fmt_time(p[isa]["median_s"]) for isa in isas]
                    + [report.fmt_range(p[isa]["min_s"], p[isa]["max_s"]) for isa in isas]
                    + [f"{p[isa]['median_s'] / p[widest]['median_s']:.2f}x" for isa in others]
                    + [fastest(r, isas), "-" if busy is None else f"{'! ' if flag else ''}others {busy:.2f} CPU"])
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]

    def line(cells):
        return "  ".join(c.ljust(w) if i in (0, len(cells) - 1) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    cpu = kinfo["cpu"]
    lines = [cpu_text,
             f"lora {kinfo.get('version')}: isa {kinfo.get('isa')} (available: {' '.join(isas)}), "
             f"threads {kinfo.get('threads')}; chosen by {kinfo.get('isa_reason')}",
             f"cpuid: {cpu['vendor']} family {cpu['family']} model {cpu['model']} stepping {cpu['stepping']}"
             f" (table row: {cpu['name'] or 'none'})",
             f"load from other processes: {load}", "",
             line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    lines += ["", f"X/{widest}: path X's median over {widest}'s (> 1: {widest} is faster); "
              "rounds visit the paths in turn, each row checked against float64 on every path"]
    if cpu["vendor"] is None:
        return lines + ["no CPU table on this architecture (no cpuid): the flags rule chooses"]
    if len(isas) < 2:
        return lines + ["one path only: nothing to compare"]
    winner, rel = suggestion(results, isas, widest)
    wins = sum(fastest(r, isas) == winner for r in results.values())
    name = cpu["name"] or "<core name>"
    lines += [f"fastest by the geometric mean of the rows' medians: {winner}, on {wins} of {len(results)} rows"
              + (" (the flags rule's path: the row only names the core)" if winner == widest else
                 f" (narrower than the flags rule's {widest}: the row names it)"),
              "suggested csrc/isa.c CPU table row" + (" (noisy)" if noisy else "") + ":",
              "    " + table_row(cpu, name, winner, widest, rel, (wins, len(results)), date, noisy)]
    return lines


def run(args):
    """``bench.py --isa-compare``: set up as the main run does, measure, print; exit status."""
    from threadpoolctl import threadpool_limits

    lora = machine.import_lora()
    c = machine.cpu_info()
    threads = args.threads or c["usable_cpus"] or 1
    cfg = TimingConfig(min_sample_s=(args.min_sample_ms or 1.0) * 1e-3, samples=args.samples or 5,
                       rounds=args.rounds or 5, impl_budget_s=0.6,
                       settle_s=(args.settle_ms if args.settle_ms is not None else 200) * 1e-3,
                       quiet_wait_s=args.wait_quiet)
    from lora import _runtime

    isas = _runtime.available_isas()  # lowest first: the last is the flags rule's
    limiter = threadpool_limits(limits=threads)
    lora.set_num_threads(threads)
    kinfo = dict(lora.kernel_info())
    progress = report.Progress(len(ROWS), enabled=not args.no_progress)
    monitor, run_monitor = machine.CpuMonitor(), machine.CpuMonitor()
    start = machine.loadavg()
    try:
        results = measure_rows(lora, isas, cfg, progress, monitor, threads)
    finally:
        limiter.restore_original_limits()
    progress.done()
    others = run_monitor.others()
    def avg(v):
        return " ".join(f"{x:.2f}" for x in v) if v else "?"

    load = (f"over the run {others:.2f} CPUs; " if others is not None else "") + \
        f"loadavg {avg(start)} at start, {avg(machine.loadavg())} at end (rows above {machine.CpuMonitor.BUSY} CPUs: !)"
    print("\n".join(report_lines(report.cpu_line(c), kinfo, results, isas, time.strftime("%Y-%m-%d"), load)))
    return 0
