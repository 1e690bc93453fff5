"""The speed targets, as a table: each names the row(s) it reads, how it reads them (a metric),
the comparison and the threshold.  ``evaluate`` is the one function that turns a target and the
finished rows into a verdict: PASS, MISS, SKIP (not measured) or noisy (a row it reads was
measured while other processes used the CPUs, so the number says little about the library).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from .machine import CpuMonitor, fmt_bytes
from .peftmodel import DECODE as PEFT_DECODE
from .peftmodel import MIXED_NAME as PEFT_MIXED
from .peftmodel import fmt_overhead, overheads
from .workloads import dorapeft, moepeft, vllmrows
from .workloads import (BANK_EDGE_NAME, DECODE_SHAPES, EDGE_BATCH, bank_name, decode_name, dora_name, edge_name,
                        gather_name, halfact_name, moe_name, prefill_name, stack_name)

DT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0", "-": "-"}


def label(w):
    """A row's name with its short dtype (none for the start-up rows)."""
    return w.name if w.dtype == "-" else f"{w.name} {DT[w.dtype]}"
_OPS = {">=": operator.ge, "<=": operator.le}


@dataclass(frozen=True)
class Rows:
    """The rows a target reads: every finished row of `group` (None: any), `dtype` and `name`."""

    group: str = None
    dtype: str = None
    name: str = None

    def select(self, W):
        return [w for w in W if "impls" in w.result and all(
            want is None or want == have
            for want, have in ((self.group, w.group), (self.dtype, w.dtype), (self.name, w.name)))]


# metrics: (rows, run) -> (value or None, detail, the rows the value came from); run: {"bw": the
# read bandwidth per level (or None), "llc_bytes": the last-level cache}.  A value of None whose
# detail starts with TICKS is a ratio the run could not measure (its samples were descheduled):
# the verdict is noisy, not SKIP.
TICKS = "no ratio: descheduled"


def _ticks(w, key):
    """The TICKS detail when `w`'s ratio against `key` is marked "ticks", else None."""
    if w.result.get("ratio_marks", {}).get(key) == "ticks":
        return (f"{TICKS} samples (ours or {key} kept too few that did not lose the CPU to the scheduler's "
                f"tick, even measured again)")
    return None

@dataclass(frozen=True)
class Speedup:
    """other's median / ours of one row (``analyse``'s speedup[key]); `inverse`: ours / other."""

    key: str
    inverse: bool = False

    def __call__(self, rows, run):
        ticks = _ticks(rows[0], self.key)
        if ticks:
            return None, ticks, rows[:1]
        v = rows[0].result.get("speedup", {}).get(self.key)
        r = rows[0].result
        how = r.get("impls", {}).get(self.key, {}).get("how")
        return (v and 1 / v if self.inverse else v), f"{self.key}: {how}" if how else "", rows[:1]


@dataclass(frozen=True)
class FastestOf:
    """The speedup over the fastest of several baselines of one row."""

    keys: tuple

    def __call__(self, rows, run):
        sp = rows[0].result.get("speedup", {})
        cands = {k: sp[k] for k in self.keys if k in sp and not _ticks(rows[0], k)}
        if not cands:
            ticks = [t for t in (_ticks(rows[0], k) for k in self.keys if k in sp) if t]
            return None, ticks[0] if ticks else "", rows[:1]
        k = min(cands, key=cands.get)
        how = rows[0].result.get("impls", {}).get(k, {}).get("how")
        return cands[k], f"best baseline: {k}" + (f" ({how})" if how else ""), rows[:1]


@dataclass(frozen=True)
class DramShare:
    """A row's GB/s over the DRAM read bandwidth measured interleaved with it (same minutes, same
    neighbours), else the start-up figure.  `cap`: no row reads faster than the DRAM read (what
    WithCached's ceiling stops at)."""

    cap = 1.0

    def __call__(self, rows, run):
        r, bw = rows[0].result, run["bw"]
        if not bw or "gb_per_s" not in r:
            return None, "", rows[:1]
        dram = r.get("dram_now_bytes_per_s", bw["DRAM"]["bytes_per_s"]) / 1e9
        detail = (f"{r['gb_per_s']:.1f} of {dram:.1f} GB/s DRAM read bandwidth measured alongside "
                  f"(at start-up: {bw['DRAM']['bytes_per_s'] / 1e9:.1f}")
        if "same_size_read_bytes_per_s" in r:
            detail += (f"; a read of the sweep's {fmt_bytes(r['bytes'])}: "
                       f"{r['same_size_read_bytes_per_s'] / 1e9:.1f} GB/s")
        if "deltas_read_bytes_per_s" in r:
            dr = r["deltas_read_bytes_per_s"] / 1e9
            share = r["impls"]["_deltas_read"]["median_s"] / r["impls"]["ours"]["median_s"]
            detail += (f"; a read of its deltas' storage, delta by delta: {dr:.1f} GB/s = "
                       f"{dr / dram:.2f} of DRAM, taking {share:.2f} of the sweep's time")
        return r["gb_per_s"] / dram, detail + ")", rows[:1]


@dataclass(frozen=True)
class LoadRatio:
    """The under-load row's worst mean ratio of a default call to a one-thread call, with every
    shape's ratio in the detail."""

    def __call__(self, rows, run):
        r = rows[0].result
        detail = ", ".join(f"{k} {v:.2f}x" for k, v in r.get("ratios", {}).items())
        return r.get("worst"), detail, rows[:1]


@dataclass(frozen=True)
class RoofShare:
    """A row's share of its roofline (the lower bound of its time from its bytes and flops and
    the measured bandwidth of the level it lives in), as a fraction."""

    def __call__(self, rows, run):
        r = rows[0].result
        if "roof_pct" not in r:
            return None, "no roofline (no bandwidth measured)", rows[:1]
        return r["roof_pct"] / 100.0, f"bound by {r.get('roof_binds', '?')}", rows[:1]


@dataclass(frozen=True)
class Milliseconds:
    """One row's median time in ms (the start-up rows), with the bare interpreter's beside it."""

    def __call__(self, rows, run):
        impls = rows[0].result["impls"]
        bare = impls.get("python_bare")
        return (impls["ours"]["median_s"] * 1e3,
                bare and f"interpreter alone (python -c pass): {bare['median_s'] * 1e3:.0f} ms", rows[:1])


@dataclass(frozen=True)
class Micros:
    """A row's median time of `impl` in µs, less that of `minus` when given (an edge: what one
    way of making a call costs over another, both timed in the same row)."""

    impl: str = "ours"
    minus: str = None

    def __call__(self, rows, run):
        impls = rows[0].result["impls"]
        missing = [k for k in (self.impl, self.minus) if k and k not in impls]
        if missing:
            return None, f"{', '.join(missing)} not measured", rows[:1]
        t = impls[self.impl]["median_s"] * 1e6
        if not self.minus:
            return t, "", rows[:1]
        t0 = impls[self.minus]["median_s"] * 1e6
        return t - t0, f"{self.impl} {t:.2f} µs, {self.minus} {t0:.2f} µs", rows[:1]


@dataclass(frozen=True)
class OverBase:
    """A vLLM serving row's time with our wrapper over row (a)'s, no adapters (same engine)."""

    def __call__(self, rows, run):
        r = rows[0].result
        if "base_ours_s" not in r:
            return None, "row (a) not measured", rows[:1]
        t = r["impls"]["ours"]["median_s"]
        return t / r["base_ours_s"], f"{t:.2f} s, (a) {r['base_ours_s']:.2f} s", rows[:1]


@dataclass(frozen=True)
class Ratio:
    """A row's median time of `impl` over that of `other` (both timed in the same row)."""

    impl: str
    other: str

    def __call__(self, rows, run):
        impls = rows[0].result["impls"]
        missing = [k for k in (self.impl, self.other) if k not in impls]
        if missing:
            return None, f"{', '.join(missing)} not measured", rows[:1]
        t, t0 = impls[self.impl]["median_s"], impls[self.other]["median_s"]
        return t / t0, f"{self.impl} {t * 1e3:.2f} ms, {self.other} {t0 * 1e3:.2f} ms", rows[:1]


@dataclass(frozen=True)
class SlowestOver:
    """The smallest speedup over the given baselines across every row that has one."""

    keys: tuple
    torch_keys_if_used: tuple = ()  # counted only in rows where torch ran (else they are NumPy's)

    def __call__(self, rows, run):
        worst, misses, used, n = None, [], [], 0
        for w in rows:
            keys = self.keys + (self.torch_keys_if_used if w.result.get("torch_used") else ())
            for k, v in w.result.get("speedup", {}).items():
                if k not in keys or _ticks(w, k):
                    continue
                used.append(w)
                n += 1
                if worst is None or v < worst[0]:
                    worst = (v, f"{w.name} {w.dtype} vs {k}")
                if v < 1.0:
                    misses.append(f"{w.name} {w.dtype} vs {k}: {v:.2f}x")
        detail = f"{n} comparisons" + (f"; worst: {worst[1]}" if worst and not misses else "")
        if misses:
            detail += f"; {len(misses)} slower: " + "; ".join(misses[:6]) + ("; ..." if len(misses) > 6 else "")
        return worst and worst[0], detail, list(dict.fromkeys(used))


@dataclass(frozen=True)
class Overhead:
    """What ours adds over the row's floor (``info["floor"]``: a run without LoRA work) as a
    fraction of what `other` adds over it: (ours - floor) / (other - floor), medians."""

    other: str

    def __call__(self, rows, run):
        r = rows[0].result
        if r.get("floor") not in r["impls"] or self.other not in r["impls"]:
            return None, f"{r.get('floor')}, {self.other} not both measured", rows[:1]
        (over, t0), (low, _) = overheads(r), overheads(r, "min_s")
        ours, other = over["ours"], over[self.other]
        detail = (f"LoRA overhead: ours {fmt_overhead(ours)} ms, {self.other} {fmt_overhead(other)} ms "
                  f"over {r['floor']} {t0 * 1e3:.2f} ms (from the minima: {fmt_overhead(low['ours'])} "
                  f"and {fmt_overhead(low[self.other])} ms)")
        if other <= 0:
            return None, detail + f"; {self.other}'s overhead is not above the floor (noise)", rows[:1]
        return max(ours, 0.0) / other, detail, rows[:1]


@dataclass(frozen=True)
class FromDram:
    """`inner`, judged only if the row's bytes per call are >= 2x the last-level cache (else it
    may be served from cache, and a DRAM verdict on it would be a guess)."""

    inner: object

    def __call__(self, rows, run):
        b = rows[0].result.get("bytes", 0)
        if b < 2 * run["llc_bytes"]:
            return (None, f"not judged: {label(rows[0])} moves {fmt_bytes(b)} per token, < 2x the "
                    f"{fmt_bytes(run['llc_bytes'])} last-level cache, so part may come from cache", rows[:1])
        return self.inner(rows, run)


@dataclass(frozen=True)
class WithCached:
    """`inner`, its detail followed by what the row's `_cached` reference measured: the same
    calls on its first layer's adapters, from cache, as a share of the row's time (near 1: the
    row is bound by its arithmetic, not by DRAM), and for q8_0 that arithmetic's speed against
    bfloat16's.  `inner`'s value scales as 1 / the row's time (a speedup, a share of the DRAM
    read), so value / share is what it would read if every byte arrived in time: the ceiling
    that reading ahead can reach without faster arithmetic, printed beside the value.  An
    `inner` with a `cap` (what its value can never pass whatever the arithmetic: DramShare's 1)
    says, for a ceiling at or past it, that the arithmetic is not what bounds the row.  A share
    of 1 or more (a reference as slow as the row: noise) or of 0 gives no ceiling."""

    inner: object

    def ceiling(self, v, share):
        """The ceiling's words for value `v` at the reference's `share` of the row's time."""
        if not 0 < share < 1:
            return f"no ceiling (the reference took {share:.2f} of the row's time)"
        c, cap = v / share, getattr(self.inner, "cap", None)
        if cap is not None and c >= cap:
            return (f"every read hidden behind that arithmetic, this value could reach {cap:g}: "
                    f"the arithmetic does not bound it")
        return f"every read hidden behind that arithmetic, this value would be at most {c:.2f}"

    def __call__(self, rows, run):
        v, detail, used = self.inner(rows, run)
        r = rows[0].result
        if v is None or "cached_share" not in r:  # not judged (its reason alone), or no reference
            return v, detail, used
        ws, llc = r.get("cached_working_set_bytes"), (run or {}).get("llc_bytes")
        if ws and llc and ws > llc / 2:
            extra = (f"the same calls on one layer's adapters would not stay in cache here "
                     f"({fmt_bytes(ws)} > half the {fmt_bytes(llc)} last-level cache): not shown")
        else:
            extra = (f"the same calls on one layer's adapters, from cache: "
                     f"{r['impls']['_cached']['median_s'] * 1e3:.2f} ms = {r['cached_share']:.2f} of its time")
            if "cached_speedup_bf16" in r:
                extra += f", {r['cached_speedup_bf16']:.2f}x bf16's from cache"
            extra += "; " + self.ceiling(v, r["cached_share"])
        detail = f"{detail}; {extra}" if detail else extra
        return v, detail, used


@dataclass(frozen=True)
class Target:
    what: str
    rows: Rows
    metric: object
    op: str  # ">=" or "<="
    threshold: float
    bar: str = None  # plot: the bar series ("tuned" or "naive") the threshold is drawn on


_SWEEP_F32, _SWEEP_BF16, _SWEEP_Q8 = Rows("sweep", "float32"), Rows("sweep", "bfloat16"), Rows("sweep", "q8_0")
_MOE_TORCH = ("torch_bmm", "gather_einsum", "torch_group", "torch_grouped_mm")
_BF16_DECODE = Rows("decode", "bfloat16", decode_name(4096, 4096, 16))

TARGETS = (
    *(Target(f"{decode_name(*s)} f32 vs NumPy tuned", Rows("decode", "float32", decode_name(*s)),
             Speedup("numpy_tuned"), ">=", 2.0, bar="tuned") for s in DECODE_SHAPES),
    *(Target(f"prefill b{n} f32 vs NumPy tuned", Rows("prefill", "float32", prefill_name(n)),
             Speedup("numpy_tuned"), ">=", 1.5, bar="tuned") for n in (128, 512)),
    Target(f"{stack_name(128)} f32 vs the faster NumPy tuned (per member / concatenated)",
           Rows("stack", "float32", stack_name(128)), FastestOf(("numpy_tuned", "numpy_cat")), ">=", 1.5,
           bar="tuned"),
    Target("gather n512 vs NumPy naive", Rows("gather", "float32", gather_name(512)),
           Speedup("numpy_naive"), ">=", 5.0, bar="naive"),
    Target("sweep float32 vs DRAM bandwidth", _SWEEP_F32, FromDram(DramShare()), ">=", 0.8),
    Target("sweep bfloat16 vs DRAM bandwidth", _SWEEP_BF16, FromDram(WithCached(DramShare())), ">=", 0.8),
    Target("sweep bf16 vs sweep f32", _SWEEP_BF16, FromDram(Speedup("ours_f32")), ">=", 1.7),
    Target("decode 4096x4096 r16 bf16 vs f32", _BF16_DECODE, Speedup("ours_f32"), ">=", 1.2),
    # q8_0 storage: past the last-level cache its 1.06 bytes per value against bf16's 2 must
    # show; in cache, its widening (int8 -> float32 times the block's scale) must not cost more
    # than the bytes save
    Target("sweep q8_0 vs DRAM bandwidth", _SWEEP_Q8, FromDram(WithCached(DramShare())), ">=", 0.85),
    Target("sweep q8_0 vs sweep bf16", _SWEEP_Q8, FromDram(WithCached(Speedup("ours_bf16"))), ">=", 1.7),
    Target("adapter-set step q8_0 vs bf16", Rows("setstep", "q8_0"), FromDram(WithCached(Speedup("ours_bf16"))),
           ">=", 1.6),
    Target("decode 4096x4096 r16 q8_0 vs bf16", Rows("decode", "q8_0", decode_name(4096, 4096, 16)),
           Speedup("ours_bf16"), ">=", 0.8),
    *(Target(f"prefill b{n} q8_0 vs bf16", Rows("prefill", "q8_0", prefill_name(n)), Speedup("ours_bf16"),
             ">=", 0.8) for n in (128, 512)),
    Target("decode 4096x4096 r16 bf16 vs NumPy tuned f32", _BF16_DECODE, Speedup("numpy_tuned_f32"), ">=", 3.0,
           bar="tuned"),
    *(t for n in (64, 512) for t in (
        Target(f"bank b{n} vs best of NumPy grouping / gather+einsum", Rows("bank", "float32", bank_name(n)),
               FastestOf(("numpy_group", "gather_einsum")), ">=", 3.0, bar="tuned"),
        Target(f"bank b{n} time / single-adapter add_batch_to time", Rows("bank", "float32", bank_name(n)),
               Speedup("single", inverse=True), "<=", 1.3))),
    *(Target(f"dora b{n} time / plain LoRA add_batch_to time", Rows("dora", "float32", dora_name(n)),
             Speedup("plain", inverse=True), "<=", 1.1) for n in (1, 128)),
    *(Target(f"prefill b512 bf16 x/out {k} vs our f32 x/out", Rows("halfact", "bfloat16", halfact_name(512, k)),
             Speedup("ours_f32act"), ">=", 1.3) for k in ("ndarray", "tensor")),
    Target("every bf16 x/out row vs PyTorch bf16", Rows("halfact"), SlowestOver(("torch",)), ">=", 2.0),
    Target("edge add_to f32 ndarray (µs)", Rows("edge", "float32", edge_name("add_to")), Micros(), "<=", 0.6),
    # a torch tensor's call, whole: its facts cost torch calls (one DLPack export and is_neg per
    # tensor, requires_grad and the grad mode), which no cache may skip (`.data =` changes them)
    *(Target(f"edge {m} {DT[a]} torch tensor (µs)", Rows("edge", a, edge_name(m, b)),
             Micros("ours_torch"), "<=", 1.0)
      for m, b in (("add_to", None), ("add_batch_to", EDGE_BATCH)) for a in ("float32", "bfloat16")),
    Target("bank b64 scaled vs best of NumPy grouping / gather+einsum / torch grouping",
           Rows("bank", "float32", bank_name(64, True)), FastestOf(("numpy_group", "gather_einsum", "torch_group")),
           ">=", 3.0, bar="tuned"),
    Target("bank b1 scaled time / single-adapter add_to time", Rows("bank", "float32", bank_name(1, True)),
           Speedup("single_add_to", inverse=True), "<=", 1.3),
    Target(f"edge LoraBank b{EDGE_BATCH} - LoraDelta add_batch_to (µs)", Rows("edge", "float32", BANK_EDGE_NAME),
           Micros("ours", "delta"), "<=", 2.0),
    Target(f"edge AdapterSet bank b{EDGE_BATCH} - LoraDelta add_batch_to (µs)",
           Rows("edge", "float32", BANK_EDGE_NAME), Micros("set", "delta"), "<=", 2.0),
    Target("no workload slower than PyTorch", Rows(), SlowestOver(("torch", "torch_cat", "torch_f32", "torch_group", "peft"),
                                                                  ("gather_einsum",)), ">=", 1.0),
    *(Target(f"{PEFT_DECODE} {DT[d]}: LoRA overhead, accelerate_peft / PEFT", Rows("peft", d, PEFT_DECODE),
             Overhead("peft_unmerged"), "<=", 1 / 3) for d in ("float32", "bfloat16")),
    # the mixed batch's LoRA work (its time over the same batch with adapters disabled) at most
    # half PEFT's adapter_names path's: the base model's own time is the same in both
    *(Target(f"{PEFT_MIXED} {DT[d]} (adapter_names): LoRA overhead, accelerate_peft / PEFT",
             Rows("peft", d, PEFT_MIXED), Overhead("peft_unmerged"), "<=", 0.5)
      for d in ("float32", "bfloat16")),
    # the MoE model: the step with adapters over the same step with the adapter layers disabled
    # (both through our experts forward), and that forward against transformers' default one
    *(t for d in ("float32", "bfloat16") for t in (
        Target(f"{moepeft.DECODE} {DT[d]}: time / the base step", Rows("peft", d, moepeft.DECODE),
               Ratio("ours", "peft_base"), "<=", 1.1),
        Target(f"{moepeft.MIXED_NAME} {DT[d]} (4 adapters + base): time / the base step at batch 8",
               Rows("peft", d, moepeft.MIXED_NAME), Ratio("ours", "peft_base"), "<=", 1.5),
        Target(f"{moepeft.DECODE} {DT[d]}: our experts forward / transformers' (adapters disabled)",
               Rows("peft", d, moepeft.DECODE), Ratio("peft_base", "transformers_base"), "<=", 1.05))),
    # DoRA on the PEFT rows' Llama: its overhead over the floor against our plain LoRA's,
    # PEFT's default DoRA's and PEFT's plain LoRA's on the same model; a batch mixing DoRA and
    # plain adapters against the same batch through one plain adapter; a scale change then a step
    *(Target(f"{row} f32: DoRA overhead, ours / {what}", Rows("peft", "float32", row), Overhead(other), "<=", limit)
      for row in (dorapeft.DECODE, dorapeft.PREFILL_NAME)
      for what, other, limit in (("our plain LoRA's", "ours_plain", 1.2), ("PEFT's default DoRA's", "peft_unmerged", 1 / 50),
                                 ("PEFT's plain LoRA's", "peft_plain", 1.0))),
    Target(f"{dorapeft.MIXED_NAME} f32 (DoRA + plain): time / the batch through one plain adapter",
           Rows("peft", "float32", dorapeft.MIXED_NAME), Ratio("ours", "ours_plain"), "<=", 1.5),
    Target(f"{dorapeft.DECODE} f32: set_scale + decode / decode", Rows("peft", "float32", dorapeft.DECODE),
           Ratio("ours_set_scale", "ours"), "<=", 2.0),
    Target("under load (busy processes, busy torch pool): mean / one thread, worst shape",
           Rows("load"), LoadRatio(), "<=", 1.3),
    Target("prefill b512 f32 share of its roofline", Rows("prefill", "float32", prefill_name(512)),
           RoofShare(), ">=", 0.75),
    Target("gather n512 f32 share of its roofline", Rows("gather", "float32", gather_name(512)),
           RoofShare(), ">=", 0.75),
    # routed experts: the best of the PyTorch formulations (torch_bmm, gather_einsum, torch_group,
    # torch_grouped_mm); at decode, the roofline of the routed experts' bytes and our dense
    # delta's time per position as the time per routed pair; at prefill, where a dense delta's
    # factors stay in cache and the experts' cannot, the plain bank path doing the same pairs
    *(t for d in ("float32", "bfloat16") for tok in (1, 512) for proj in ("gate_up", "down") for t in (
        Target(f"{moe_name(proj, tok)} {DT[d]} vs best torch", Rows("moe", d, moe_name(proj, tok)),
               FastestOf(_MOE_TORCH), ">=", 3.0, bar="tuned"),
        *((Target(f"{moe_name(proj, tok)} {DT[d]} time per pair / dense delta per position",
                  Rows("moe", d, moe_name(proj, tok)), Speedup("dense", inverse=True), "<=", 1.1),
           Target(f"{moe_name(proj, tok)} {DT[d]} share of its roofline", Rows("moe", d, moe_name(proj, tok)),
                  RoofShare(), ">=", 0.6)) if tok == 1 else
          (Target(f"{moe_name(proj, tok)} {DT[d]} time / the same pairs through a LoraBank",
                  Rows("moe", d, moe_name(proj, tok)), Speedup("bank", inverse=True), "<=", 1.1),)))),
    # vLLM on the CPU (lora.vllm): its CPU LoRA methods against its stock wrapper and grouped
    # torch; whole LLM.generate runs with adapters over the same engine's run without any
    *(t for name in vllmrows.OP_ROWS for t in (
        Target(f"{name} bf16 vs vLLM's stock wrapper", Rows("vllm", "bfloat16", name),
               Speedup("vllm_stock"), ">=", 20.0),
        Target(f"{name} bf16 vs grouped torch", Rows("vllm", "bfloat16", name),
               Speedup("torch_grouped"), ">=", 2.0))),
    *(t for _, name in vllmrows.SERVE_ROWS[1:] for t in (
        Target(f"{name}: time / (a) no adapters", Rows("vllm serving", "bfloat16", name), OverBase(),
               "<=", 1.15),
        Target(f"{name}: throughput vs vLLM's stock wrapper", Rows("vllm serving", "bfloat16", name),
               Speedup("vllm_stock"), ">=", 3.0))),
    Target("import lora, fresh interpreter (ms)", Rows("startup", name="python -c 'import lora'"),
           Milliseconds(), "<=", 150),
    Target("python -m lora info (ms)", Rows("startup", name="python -m lora info"), Milliseconds(), "<=", 300),
)


def evaluate(target, W, run, busy_limit=CpuMonitor.BUSY):
    """The verdict on one target: a dict (the JSON's "targets" entries)."""
    out = {"target": target.what, "value": None, "op": target.op, "threshold": target.threshold,
           "status": "SKIP", "detail": "not measured", "rows": []}
    rows = target.rows.select(W)
    if not rows:
        return out
    value, detail, used = target.metric(rows, run)
    out["rows"] = [label(w) for w in used]
    if value is None:
        out["detail"] = detail or "not measured"
        if detail.startswith(TICKS):
            out["status"] = "noisy"
        return out
    out["value"], out["detail"] = value, detail
    out["status"] = "PASS" if _OPS[target.op](value, target.threshold) else "MISS"
    loaded = [(w.result["others_cpu"], w) for w in used if (w.result.get("others_cpu") or 0) > busy_limit]
    if loaded:
        busy, w = max(loaded, key=lambda x: x[0])
        why = (f"other processes used {busy:.2f} CPUs while {label(w)} was measured "
               f"(> {busy_limit:g}" + (f"; {len(loaded)} of {len(used)} rows loaded" if len(used) > 1 else "")
               + f"), would be {out['status']}")
        out["status"], out["detail"] = "noisy", why + (f"; {detail}" if detail else "")
    return out


def evaluate_all(W, run):
    return [evaluate(t, W, run) for t in TARGETS]
