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
    res["impls"] = {name: {**summarize(v), "calls_per_sample": built.impls[name].k} for name, v in samples.items()}
    for name, impl in built.impls.items():
        if impl.keep is not None:  # a read reference: record its size
            res["impls"][name]["bytes"] = impl.keep.nbytes
    return res


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
    sp = {}
    for name, r in res["impls"].items():
        if name != "ours" and not name.startswith("_"):
            sp[name] = r["median_s"] / t
    twin = by_key.get(wl.key) if wl.dtype != "float32" and wl.key else None
    if twin is not None and "impls" in twin.result:
        for name in ("numpy_naive", "numpy_tuned", "numpy_cat", "torch", "torch_cat"):
            if name in twin.result["impls"]:
                sp[name + "_f32"] = twin.result["impls"][name]["median_s"] / t
        sp["ours_f32"] = twin.result["impls"]["ours"]["median_s"] / t
    res["speedup"] = sp
