"""The runner: one row checked against float64 once, then every implementation timed; and the
analysis of a finished row (GB/s, GFLOP/s, roofline, speedups)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..machine import level_for
from ..timing import measure, summarize


def rel_err(ours, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(ours, np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def run_workload(wl, ctx, cfg, status, monitor=None):
    """Check the row's result against float64 once, then time every implementation."""
    if wl.run is not None:
        return wl.run(ctx, cfg, status, monitor)
    built = wl.build(ctx)
    ours_once, ref_once, tol = built.check
    err = rel_err(ours_once(), ref_once())
    res = {"bytes": built.bytes, "flops": built.flops, "check_rel_err": err}
    if not err <= tol:
        raise AssertionError(f"result differs from the float64 reference: relative error {err:.2e} > {tol:.0e}")
    res.update(built.info or {})
    if built.timing:
        cfg = replace(cfg, **built.timing)
        res["timing"] = built.timing
    samples, res["others_cpu"] = measure(built.impls, cfg, status, wl.name, monitor)
    impls = built.impls
    res["impls"] = {name: {**summarize(v, impls[name].k, impls[name].best, impls[name].waited),
                           "calls_per_sample": impls[name].k} for name, v in samples.items()}
    for name, impl in impls.items():
        if impl.keep is not None:  # a read reference: record its size
            res["impls"][name]["bytes"] = impl.keep.nbytes
    res["impls"], res["candidates"] = fold_candidates(res["impls"])
    return res


def fold_candidates(impls):
    """A baseline measured in several formulations (impls named ``"numpy_tuned:how"``, timed in
    the same rounds) becomes one impl: the fastest formulation with a clean median (any, when
    none is clean), its ``how`` recorded.  Returns (impls, {baseline: {how: median}})."""
    out, cands = {}, {}
    for name, r in impls.items():
        base, sep, how = name.partition(":")
        if not sep:
            out[name] = r
            continue
        cands.setdefault(base, {})[how] = r
    for base, ways in cands.items():
        how = min(ways, key=lambda h: (not ways[h]["clean"], ways[h]["median_s"]))
        out[base] = {**ways[how], "how": how}
    return out, {base: {h: r["median_s"] for h, r in ways.items()} for base, ways in cands.items()}


def analyse(wl, res, bw, peak, threads, caches, by_key):
    """GB/s, GFLOP/s, roofline and speedups of one finished workload (in place).

    The roofline: a working set (the bytes of one call, or ``working_set_bytes`` when a row
    declares it) lives in the smallest level that holds it (``level_for``); the
    lower bound of a call's time is max(bytes / bandwidth(level), flops / peak); "% roof" is that
    bound over the measured median.  The sweep's bandwidth is that of a read of its own size
    measured alongside it."""
    t = res["impls"]["ours"]["median_s"]
    res["gb_per_s"] = res["bytes"] / t / 1e9
    res["gflop_per_s"] = res["flops"] / t / 1e9
    # where the data lives: the bytes of one call, or the working set a row declares when its
    # calls move through more (the moe rows: each call routes to other experts)
    level = level_for(res.get("working_set_bytes", res["bytes"]), threads, caches)
    res["level"] = level
    for ref, key in (("_dram_read", "dram_now_bytes_per_s"), ("_same_size_read", "same_size_read_bytes_per_s"),
                     ("_deltas_read", "deltas_read_bytes_per_s")):
        if ref in res["impls"]:
            r = res["impls"][ref]
            res[key] = r["bytes"] / r["median_s"]
    if bw and (res["bytes"] or res["flops"]):  # the edge rows move nothing: no roof
        level_bw = res.get("same_size_read_bytes_per_s", bw[level]["bytes_per_s"])
        bound = res["bytes"] / level_bw
        binds = "memory"
        if peak and res["flops"] / peak > bound:
            bound, binds = res["flops"] / peak, "compute"
        res["roof_time_s"], res["roof_binds"] = bound, binds
        res["roof_pct"] = 100.0 * bound / t
    sp, marks = {}, {}
    ours = res["impls"]["ours"]

    def ratio(key, r):
        sp[key] = r["median_s"] / t
        marks[key] = ratio_mark(r, ours)

    for name, r in res["impls"].items():
        if name != "ours" and not name.startswith("_"):
            ratio(name, r)
    twin = by_key.get(wl.key) if wl.dtype != "float32" and wl.key else None
    if twin is not None and "impls" in twin.result:
        for name in ("numpy_naive", "numpy_tuned", "numpy_cat", "torch", "torch_cat"):
            if name in twin.result["impls"]:
                ratio(name + "_f32", twin.result["impls"][name])
        ratio("ours_f32", twin.result["impls"]["ours"])
    # a q8_0 row against its bfloat16 twin (the format it halves the bytes of)
    bf16 = by_key.get((wl.key, "bfloat16")) if wl.dtype == "q8_0" and wl.key else None
    if bf16 is not None and "impls" in bf16.result:
        ratio("ours_bf16", bf16.result["impls"]["ours"])
    # the same calls on one layer's adapters, from cache (the sweep and the set step): the share
    # of the row's time its arithmetic takes, and for q8_0 that arithmetic against bfloat16's
    if "_cached" in res["impls"]:
        res["cached_share"] = res["impls"]["_cached"]["median_s"] / t
        if bf16 is not None and "_cached" in bf16.result.get("impls", {}):
            res["cached_speedup_bf16"] = (bf16.result["impls"]["_cached"]["median_s"]
                                          / res["impls"]["_cached"]["median_s"])
    res["speedup"] = sp
    res["ratio_marks"] = {k: v for k, v in marks.items() if v}


def ratio_mark(other, ours):
    """How far a ratio of two medians can be trusted: "ticks" when either side kept too few
    samples that were not descheduled (no ratio: it would measure the scheduler), "~" when
    descheduled samples were set apart on either side, "" when none was."""
    if not (other.get("clean", True) and ours.get("clean", True)):
        return "ticks"
    return "~" if other.get("descheduled") or ours.get("descheduled") else ""
