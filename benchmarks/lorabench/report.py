"""What a run prints and writes: the header (machine, ISA, threads, bandwidth, load), the table,
the baselines, the targets, the JSON document and the plot; and the progress line on stderr."""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

from .machine import LANES, LEVELS, CpuMonitor, fmt_bytes
from .peftmodel import fmt_overhead, overheads
from .targets import DT, TARGETS

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


_BASE_NAMES = {
    "numpy_naive": "NumPy naive", "numpy_tuned": "NumPy tuned", "torch": "PyTorch",
    "numpy_cat": "NumPy tuned, concatenated stack", "torch_cat": "PyTorch, concatenated stack",
    "numpy_group": "NumPy grouping", "gather_einsum": "gather+einsum", "torch_group": "PyTorch grouping",
    "single": "single-adapter add_batch_to", "_dram_read": "DRAM read reference",
    "_same_size_read": "same-size read reference", "_deltas_read": "read of the deltas' storage",
    "_cached": "the same calls on the first layer's adapters (from cache)",
    "numpy_naive_f32": "NumPy naive (f32)",
    "numpy_tuned_f32": "NumPy tuned (f32)", "ours_f32": "ours f32", "torch_f32": "PyTorch f32",
    "single_add_to": "single-adapter add_to", "ours_f32act": "ours, f32 x/out", "peft": "PEFT (f32 upcast)",
    "peft_dora": "PEFT's DoRA forward (torch, norm every call)",
    "ours_torch": "ours, torch tensors", "set": "AdapterSet bank", "delta": "LoraDelta add_batch_to",
    "edge": "edge (every scale 0)", "peft_unmerged": "PEFT", "peft_bf16_adapters": "PEFT, adapters bf16",
    "peft_base": "adapter layers disabled (floor)",
    "transformers_base": "adapter layers disabled, transformers' experts",
    "peft_dora_cached": "PEFT, DoRA norm cache on", "ours_plain": "ours, plain LoRA", "peft_plain": "PEFT, plain LoRA",
    "ours_set_scale": "ours, set_scale + decode",
}


def cpu_line(c):
    """The "CPU: ..." line of a report, from ``machine.cpu_info()``."""
    cpu = c["model"]
    if c.get("family_model"):
        cpu += f" ({c['family_model']}" + (f", {c['microarchitecture']}" if c.get("microarchitecture") else "") + ")"
    return (f"CPU: {cpu}, {c['logical_cpus']} logical CPUs ({c['usable_cpus']} usable)"
            + (f", {c['mhz']:.0f} MHz nominal" if c.get("mhz") else "")
            + (f", {' '.join(c['simd_flags'])}" if c.get("simd_flags") else ""))


def header_lines(meta):
    c, k = meta["cpu"], meta["lora"]
    lines = [
        f"lora-kernels benchmark  {meta['date']}  python {meta['python']}  numpy {meta['numpy']}"
        f"  torch {meta['torch'] or '-'}" + ("  [--quick]" if meta["quick"] else ""),
        cpu_line(c),
        "caches: L1d {} /core, L2 {} /core, L3 {} ({}); last level {}; memory available {}".format(
            fmt_bytes(c["caches"]["L1d"]), fmt_bytes(c["caches"]["L2"]), fmt_bytes(c["caches"]["L3"]),
            c["caches_source"], c["llc"]["level"],
            fmt_bytes(c["mem_available_bytes"]) if c.get("mem_available_bytes") else "unknown"),
        f"lora {k.get('version')} ({meta['lora_path']}): isa {k.get('isa')} (available: "
        f"{' '.join(k.get('available_isas', []))}), openmp {k.get('openmp')}, threads {k.get('threads')}, "
        f"compiler {k.get('compiler')}",
        f"isa chosen by {k.get('isa_reason', '?')}",
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
    sz = meta.get("sweep_sizing")
    if sz:
        lines.append(f"model sweep: {sz['layers']} layers of Llama-2-7B shapes, rank 16: adapters "
                     f"{fmt_bytes(sz['adapter_bytes']['float32'])} f32, {fmt_bytes(sz['adapter_bytes']['half'])} "
                     f"f16/bf16"
                     + (f", {fmt_bytes(sz['adapter_bytes']['q8_0'])} q8_0 = {sz['q8_0_over_llc']:.1f}x"
                        if "q8_0" in sz["adapter_bytes"] else f" = {sz['half_over_llc']:.1f}x")
                     + f" the {fmt_bytes(sz['llc_bytes'])} last-level cache"
                     + (f" (set by {sz['capped_by']}; 2x the cache wants {sz['layers_wanted']} layers)"
                        if sz["capped_by"] else ""))
    ss = meta.get("set_step_sizing")
    if ss and "q8_0_step_bytes" in ss:
        lines.append(f"adapter-set step: {ss['layers']} layers x 8 adapters, {ss['adapters_used']} of them used by "
                     f"its sequences: a q8_0 step reads {fmt_bytes(ss['q8_0_step_bytes'])} = "
                     f"{ss['q8_0_over_llc']:.1f}x the last-level cache"
                     + (f" (set by {ss['capped_by']}; 2x the cache wants {ss['layers_wanted']} layers)"
                        if ss["capped_by"] else ""))
    load = meta.get("load")
    if load:
        lines.append("load from other processes: " + "; ".join(
            f"{k} {v:.2f} CPUs" for k, v in (("at start", load.get("others_cpu_at_start")),
                                            ("over the run", load.get("others_cpu_run")),
                                            ("during the bandwidth runs", load.get("others_cpu_bandwidth")))
            if v is not None)
            + (f"; loadavg {' '.join(f'{x:.2f}' for x in load['loadavg_start'])} at start, "
               f"{' '.join(f'{x:.2f}' for x in load['loadavg_end'])} at end" if load.get("loadavg_end") else "")
            + f" (rows measured above {CpuMonitor.BUSY:g} CPUs are marked ! and their targets noisy)")
    peak = _peak_line(meta)
    if peak:
        lines.append(peak)
    return lines


def _peak_line(meta):
    """The header's compute peak: the measured one with the nominal beside it, else the nominal."""
    k = meta["lora"]
    nominal = meta.get("peak_flops_nominal")
    nominal_text = (f"{meta['threads']} threads x {meta['cpu']['mhz'] / 1e3:.2f} GHz x "
                    f"{LANES.get(k.get('isa'), 1) * 4} flop/cycle ({k.get('isa')}: lanes x FMA x 2 ports) = "
                    f"{nominal / 1e9:.0f} GFLOP/s" if nominal else "")
    if meta.get("peak_measured"):
        return (f"compute peak (C kernel lora_bench_fma, {meta['threads']} threads, float32 FMA chains, best of "
                f"{meta['bw_trials']} at start and at end): {meta['peak_flops'] / 1e9:.0f} GFLOP/s"
                + (f" = {meta['peak_flops'] / nominal:.2f}x the nominal {nominal_text}" if nominal else ""))
    return f"compute peak (nominal; the measurement failed): {nominal_text}" if nominal else None


def _ratio(v, mark=""):
    """A ratio cell: the value and its mark ("~": descheduled samples set apart, "!": measured
    while other processes were busy), or "ticks" where no ratio can be had (see `marks_note`)."""
    if mark == "ticks":
        return "ticks"
    if v is None:
        return "-"
    return (f"{v:.2f}x" if v < 10 else f"{v:.1f}x" if v < 100 else f"{v:.0f}x") + mark


def marks_note():
    """The legend of the table's marks."""
    return [
        "marks, next to the number they qualify: ~ = samples descheduled by the scheduler (about a whole",
        "  number of its ~4 ms ticks past the fastest this implementation ran, or spent waiting for a CPU) were",
        f"  set apart before the median; ! = other processes used more than {CpuMonitor.BUSY:g} CPUs while the row was",
        "  measured; ticks = no ratio: one side kept too few samples that were not descheduled, even measured",
        "  again (it would time the scheduler, not the code).",
    ]


def _busy(w):
    return (w.result.get("others_cpu") or 0) > CpuMonitor.BUSY


def _cell(w, key):
    """The ratio cell of one row against baseline `key` (None: no such column)."""
    if key is None:
        return "-"
    r = w.result
    mark = r.get("ratio_marks", {}).get(key, "")
    return _ratio(r["speedup"].get(key), mark if mark == "ticks" else mark + ("!" if _busy(w) else ""))


def _faster(sp, per_member, concatenated):
    """A stack's baseline: the faster of its per-member calls and its concatenated pair, and
    which one that was (the key and its name)."""
    a, b = sp.get(per_member), sp.get(concatenated)
    if b is not None and (a is None or b < a):
        return concatenated, "concatenated"
    return per_member, "per member"


def _how(r, key):
    """The formulation a folded baseline kept (``runner.fold_candidates``), or None."""
    return r["impls"].get(key, {}).get("how") if key else None


def table_lines(W):
    head = ("workload", "dtype", "ours median", "min-max", "GB/s", "GFLOP/s", "level", "%roof",
            "vs naive", "vs tuned", "vs torch", "other")
    rows = []
    for w in W:
        r = w.result
        if w.group in ("startup", "load") and "impls" in r:
            continue  # their own lines: startup_lines, and the load target's detail
        if "speedup" not in r:
            status = r.get("skip") and "skipped: " + r["skip"] or "ERROR: " + r.get("error", "?")
            rows.append((w.name, DT[w.dtype], status))
            continue
        o, sp = r["impls"]["ours"], r["speedup"]
        suffix = "_f32" if w.dtype != "float32" else ""
        other = []
        naive = tuned = tor = None
        if w.group == "bank":
            naive, tuned, tor = "numpy_group", "gather_einsum", "torch_group"
            other.append("naive=NumPy grouping, tuned=gather+einsum" + (" (torch)" if r.get("torch_used") else " (NumPy)"))
            other.append(f"bank/single {1 / sp['single']:.2f}x")
            if "single_add_to" in sp:
                other.append(f"bank/add_to {1 / sp['single_add_to']:.2f}x")
        elif w.group in ("edge", "setstep"):
            other += _edge_notes(w)
        elif w.group == "peft":
            other += _peft_notes(w)
        elif w.group == "dora":
            naive = "numpy_naive"
            other.append(f"DoRA/plain LoRA {1 / sp['plain']:.2f}x")
            if "peft_dora" in sp:
                other.append(f"vs PEFT's default DoRA (norm every call) {_ratio(sp['peft_dora'])}")
        elif w.group in ("vllm", "vllm serving"):
            naive = tuned = tor = None
            other += _vllm_notes(w)
        elif w.group == "merge":
            tor = "torch"
            if "peft" in sp:
                other.append(f"vs PEFT's CPU merge {_ratio(sp['peft'])}")
            other.append("ours: float64 sum, rounded once, overflow checked before writing")
        else:
            naive, tuned, tor = "numpy_naive" + suffix, "numpy_tuned" + suffix, "torch"
            if "numpy_cat" + suffix in sp or "torch_cat" in sp:  # a stack: the faster formulation
                tuned, tuned_how = _faster(sp, "numpy_tuned" + suffix, "numpy_cat" + suffix)
                tor, torch_how = _faster(sp, "torch", "torch_cat")
                other.append(f"tuned={tuned_how}, torch={torch_how}")
            hows = [f"{col}: {h}" for col, k in (("tuned", tuned), ("torch", tor)) if (h := _how(r, k))]
            if hows:
                other.append("; ".join(hows))
            if "ours_f32act" in sp:  # bf16 x/out: against our f32 x/out call and PEFT's upcast
                other.append(f"vs ours f32 x/out {_cell(w, 'ours_f32act')}")
                if "peft" in sp:
                    other.append(f"vs PEFT f32 upcast {_cell(w, 'peft')}")
            if suffix and (w.group != "halfact" or "ours_f32" in sp):
                other.append(f"vs ours f32 {_cell(w, 'ours_f32')}")
                if "torch_f32" in sp:
                    other.append(f"vs torch f32 {_cell(w, 'torch_f32')}")
        moved = r["bytes"] or r["flops"]
        ours_mark = ("~" if o.get("descheduled") else "") + ("!" if _busy(w) else "")
        rows.append((w.name, DT[w.dtype], fmt_time(o["median_s"]) + ours_mark, fmt_range(o["min_s"], o["max_s"]),
                     f"{r['gb_per_s']:.1f}" if moved else "-", f"{r['gflop_per_s']:.1f}" if moved else "-",
                     r["level"] if moved else "-",
                     f"{r['roof_pct']:.0f}%" if "roof_pct" in r else "-",
                     _cell(w, naive if naive in sp else None), _cell(w, tuned if tuned in sp else None),
                     _cell(w, tor if tor in sp else None), "; ".join(other)))
    widths = [max([len(h)] + [len(x[i]) for x in rows if len(x) == len(head)]) for i, h in enumerate(head)]
    right = {2, 3, 4, 5, 7, 8, 9, 10}

    def fmt(cells):
        if len(cells) != len(head):
            return f"{cells[0]:<{widths[0]}}  {cells[1]:<{widths[1]}}  {cells[2]}"
        return "  ".join((c.rjust(wd) if i in right else c.ljust(wd)) for i, (c, wd) in enumerate(zip(cells, widths))).rstrip()

    lines = [fmt(head), "  ".join("-" * wd for wd in widths)]
    lines += [fmt(x) for x in rows]
    return lines


def _edge_notes(w):
    """The "other" column of the edge rows (what the other calls cost over ours) and of the
    adapter-set step (its edge, its share, what the set costs to build)."""
    r = w.result
    impls = r["impls"]
    t = impls["ours"]["median_s"]
    if w.group == "setstep":
        e = impls["edge"]["median_s"]
        return [f"edge (every scale 0) {fmt_time(e)} = {100 * e / t:.0f}% of the step",
                f"{r['bank_calls']} bank calls", f"{r['adapters']} adapters: {fmt_bytes(r['adapter_bytes'])} {w.dtype}, "
                f"built in {r['build_s']:.1f} s"]
    if "delta" in impls:
        d = impls["delta"]["median_s"]
        return [f"LoraDelta {fmt_time(d)}; LoraBank +{(t - d) * 1e6:.2f} µs, AdapterSet bank "
                f"+{(impls['set']['median_s'] - d) * 1e6:.2f} µs"]
    if "ours_torch" in impls:
        return [f"tensors {fmt_time(impls['ours_torch']['median_s'])}, "
                f"{(impls['ours_torch']['median_s'] - t) * 1e6:+.2f} µs over ndarrays"]
    return []


def _vllm_notes(w):
    """The "other" column of the vLLM rows: vLLM's stock wrapper and grouped torch as ratios;
    a serving row's time over (a)'s with the same wrapper, and both wrappers' throughput."""
    r, sp = w.result, w.result["speedup"]
    notes = [f"vs vLLM stock {_ratio(sp.get('vllm_stock'))}"]
    if "torch_grouped" in sp:
        notes.append(f"vs grouped torch {_ratio(sp['torch_grouped'])}")
    if "ours_padded" in sp:
        notes.append(f"padded ranks computed: {sp['ours_padded']:.2f}x the time")
    if "base_ours_s" in r:
        ours, stock = r["impls"]["ours"]["median_s"], r["impls"]["vllm_stock"]["median_s"]
        notes.append(f"x (a): ours {ours / r['base_ours_s']:.2f}x, stock {stock / r['base_stock_s']:.2f}x")
        notes.append(f"tok/s: ours {r['tokens'] / ours:.0f}, stock {r['tokens'] / stock:.0f}")
    if "tokens" in r and "base_rows" in r:
        notes.append(f"{r['tokens']} tokens ({r['base_rows']} base) over {r['slots']} slots, r{r['rank']}"
                     + (f" in max_lora_rank {r['r_max']}" if r.get("r_max", r["rank"]) != r["rank"] else ""))
    return notes


def _peft_notes(w):
    """The "other" column of the PEFT rows: PEFT's times as ratios, and the LoRA overhead of each
    over the row's floor."""
    r = w.result
    (over, t0), (low, _) = overheads(r), overheads(r, "min_s")
    notes = [f"{r['layers']} layers"] + [f"vs {_BASE_NAMES[k]} {_ratio(r['speedup'][k])}" for k in over if k != "ours"]
    notes.append(f"{_BASE_NAMES[r['floor']]} {fmt_time(t0)}; LoRA overhead, median (min): " + ", ".join(
        f"{'ours' if k == 'ours' else _BASE_NAMES[k]} {fmt_overhead(v)} ({fmt_overhead(low[k])}) ms"
        for k, v in over.items()))
    return notes


def baseline_lines(W):
    lines = ["baseline times (median, min-max; a tuned baseline: the formulation kept, the others' medians):"]
    for w in W:
        impls = w.result.get("impls")
        if not impls:
            continue
        cands = w.result.get("candidates", {})
        cells = []
        for k, v in impls.items():
            if k == "ours":
                continue
            cell = f"{_BASE_NAMES.get(k, k)} {fmt_time(v['median_s'])} ({fmt_range(v['min_s'], v['max_s'])})"
            if v.get("descheduled"):
                cell += f" [{v['descheduled']} of {v['n']} samples descheduled, set apart]"
            if k in cands:
                cell += f" [{v['how']}; " + ", ".join(f"{h} {fmt_time(t)}" for h, t in cands[k].items()
                                                      if h != v["how"]) + "]"
            cells.append(cell)
        if cells:
            lines.append(f"  {w.name} {DT[w.dtype]}: " + "; ".join(cells))
    return lines


# the baselines the closing summary counts as NumPy's (bank: gather+einsum is NumPy's when torch
# did not run) and as PyTorch's (`_best_torch`)
_NUMPY_KEYS = ("numpy_naive", "numpy_tuned", "numpy_cat", "numpy_group")


def _best(w, keys):
    """(speedup over the fastest of `keys` this row has, its key), leaving out any ratio marked
    "ticks"; (None, None) when there is none."""
    sp, marks = w.result["speedup"], w.result.get("ratio_marks", {})
    vals = [(sp[k], k) for k in keys if k in sp and marks.get(k) != "ticks"]
    return min(vals) if vals else (None, None)


def _numpy_keys(w):
    suffix = "_f32" if w.dtype != "float32" else ""
    keys = [k + suffix for k in _NUMPY_KEYS]
    if w.group == "bank" and not w.result.get("torch_used"):
        keys.append("gather_einsum")
    return keys


def _torch_keys(w):
    keys = ["torch", "torch_cat", "torch_f32", "torch_group", "peft"]
    if w.result.get("torch_used"):
        keys.append("gather_einsum")
    return keys


def _geomean(vals):
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def summary_lines(W, meta):
    """The closing summary: on how many rows lora is faster than the fastest NumPy and the
    fastest PyTorch formulation measured, the geometric mean of those ratios, how many rows were
    noisy and why, and how long the run took on which machine under which load."""
    rows = [w for w in W if "speedup" in w.result and w.group not in ("edge", "setstep", "peft")]
    lines = ["summary:"]
    for what, keys in (("NumPy", _numpy_keys), ("PyTorch", _torch_keys)):
        got = [(v, w) for w in rows for v, _ in [_best(w, keys(w))] if v is not None]
        if not got:
            continue
        vals = [v for v, _ in got]
        lo, hi = min(got, key=lambda x: x[0]), max(got, key=lambda x: x[0])
        lines.append(f"  vs the fastest {what} formulation measured: lora faster on {sum(v > 1 for v in vals)} of "
                     f"{len(vals)} rows; geometric mean {_ratio(_geomean(vals))} (lowest {_ratio(lo[0])}: "
                     f"{lo[1].name} {DT[lo[1].dtype]}; highest {_ratio(hi[0])}: {hi[1].name} {DT[hi[1].dtype]})")
    timed = [w for w in W if "impls" in w.result and w.group not in ("startup", "load")]
    busy = [w for w in timed if _busy(w)]
    sets = [w for w in timed if any(v.get("descheduled") for v in w.result["impls"].values())]
    lost = [(w, k) for w in timed for k, m in w.result.get("ratio_marks", {}).items() if m == "ticks"]
    lines.append(f"  noisy rows: {len({id(w) for w in busy + sets})} of {len(timed)} timed rows: {len(busy)} measured "
                 f"while other processes used > {CpuMonitor.BUSY:g} CPUs (!), {len(sets)} with descheduled samples "
                 f"set apart (~)" + (f"; {len(lost)} ratio(s) not computed (ticks): "
                                    + ", ".join(f"{w.name} {DT[w.dtype]} vs {k}" for w, k in lost[:6])
                                    + (", ..." if len(lost) > 6 else "") if lost else "; every ratio computed"))
    if busy:
        worst = max(busy, key=lambda w: w.result["others_cpu"])
        lines.append(f"    busiest: {worst.name} {DT[worst.dtype]}, other processes {worst.result['others_cpu']:.2f} "
                     f"CPUs")
    if meta.get("elapsed_s") is not None:
        load = meta.get("load") or {}
        la = load.get("loadavg_start"), load.get("loadavg_end")
        lines.append(f"  this run: {meta['elapsed_s']:.0f} s" + (" (--quick)" if meta["quick"] else "")
                     + f" on {meta['cpu']['model']}, {meta['threads']} threads"
                     + (f"; load average {la[0][0]:.2f} at start, {la[1][0]:.2f} at end" if all(la) else "")
                     + (f"; other processes {load['others_cpu_run']:.2f} CPUs over the run"
                        if load.get("others_cpu_run") is not None else ""))
    return lines


def startup_lines(W):
    rows = [w for w in W if w.group == "startup" and "impls" in w.result]
    if not rows:
        return []
    lines = [f"start-up (fresh interpreter per run, median of {rows[0].result['runs']}, min-max):"]
    for w in rows:
        o, bare = w.result["impls"]["ours"], w.result["impls"]["python_bare"]
        busy = w.result.get("others_cpu")
        lines.append(f"  {w.name:<26} {fmt_time(o['median_s']):>9}  {fmt_range(o['min_s'], o['max_s']):>14}"
                     f"   interpreter alone {fmt_time(bare['median_s'])}, lora's share "
                     f"{fmt_time(o['median_s'] - bare['median_s'])}"
                     + (f"  ! others used {busy:.1f} CPU" if busy is not None and busy > CpuMonitor.BUSY else ""))
    return lines


def target_lines(results, quick, only=False):
    """The verdicts; `only` (a run of some rows, --only): the targets no row of it feeds are left out."""
    if only:
        results = [t for t in results if t["rows"] or t["status"] != "SKIP"]
        if not results:
            return []
    lines = ["targets" + (" (quick run: indicative only)" if quick else "") + ":"]
    wd = max(len(t["target"]) for t in results)
    for t in results:
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"  {t['status']:<5}  {t['target']:<{wd}}  {v:>6} ({t['op']} {t['threshold']:g})"
                     + (f"  {t['detail']}" if t["detail"] else ""))
    return lines


def json_doc(meta, notes, W, results):
    return {"meta": meta, "notes": notes,
            "workloads": [{"name": w.name, "group": w.group, "dtype": w.dtype, **w.result} for w in W],
            "targets": results}


def _best_torch(w):
    """Speedup over the fastest PyTorch way of doing this row's job (None without torch, or
    where every such ratio is marked "ticks")."""
    return _best(w, _torch_keys(w))[0]


def plot(path, W, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from matplotlib.patches import Patch

    # the start-up, edge, adapter-set and whole-model PEFT rows have no speedup bars
    done = [w for w in W if "speedup" in w.result and w.group not in ("edge", "setstep", "peft")]
    labels = [f"{w.name} {DT[w.dtype]}" + (" !" if (w.result.get("others_cpu") or 0) > CpuMonitor.BUSY else "")
              for w in done]

    def numpy_ratio(w, kind):  # kind: "tuned" | "naive"; no bar for a ratio marked "ticks"
        if w.group == "bank":
            keys = ("numpy_group", "gather_einsum") if kind == "tuned" else ("numpy_group",)
        else:
            suffix = "_f32" if w.dtype != "float32" else ""
            keys = ("numpy_tuned" + suffix, "numpy_cat" + suffix) if kind == "tuned" else ("numpy_naive" + suffix,)
        return _best(w, keys)[0]

    series = [("vs the fastest NumPy tuned formulation (bank: best of grouping, gather+einsum)", lambda w: numpy_ratio(w, "tuned"), "#4c72b0"),
              ("vs NumPy naive (bank: grouping)", lambda w: numpy_ratio(w, "naive"), "#a1c0e8"),
              ("vs the fastest PyTorch variant", _best_torch, "#dd8452")]
    # the targets that read one row's bar, drawn on it: (row index, series index, threshold)
    index = {id(w): i for i, w in enumerate(done)}
    series_of = {"tuned": 0, "naive": 1}
    tmarks = [(index[id(w)], series_of[t.bar], t.threshold) for t in TARGETS if t.bar
              for w in t.rows.select(done)[:1]]

    n = len(done)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 0.34 * n + 2.8), sharey=True,
                                  gridspec_kw={"width_ratios": [2.2, 1]})
    y = np.arange(n)
    h = 0.27
    for j, (lab, fn, col) in enumerate(series):
        pts = [(yy + (j - 1) * h, fn(w)) for yy, w in zip(y, done)]
        pts = [(yy, v) for yy, v in pts if v]
        ax.barh([p[0] for p in pts], [p[1] for p in pts], height=h, color=col, label=lab)
    for i, j, thr in tmarks:
        off = (j - 1) * h
        ax.plot([thr, thr], [i + off - h / 2, i + off + h / 2], color="crimson", lw=2.5)
    ax.plot([], [], color="crimson", lw=2.5, label="target")
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
             "working set lives in, or flops / the measured compute peak.  ! = other processes were using the CPUs.",
             fontsize=7.5)
    fig.tight_layout(rect=(0, 0.015, 1, 0.99))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
