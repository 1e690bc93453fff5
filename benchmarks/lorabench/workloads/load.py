"""Under load: calls against one thread while other work keeps every core busy, measured by
``benchmarks/oversubscription.py`` in child processes (it makes the load itself)."""

from __future__ import annotations

LOAD_NAME = "under load: mean call time / one thread's (worst shape)"


def measure_under_load(quick, status):
    """benchmarks/oversubscription.py's measurement (children under busy processes and a busy
    torch pool in-process; it makes the load itself, so foreign load does not make it noisy):
    the worst mean ratio of a default call to a one-thread call under the same load."""
    import oversubscription  # benchmarks/ is on the path: bench.py lives there

    status("under load: busy processes and a busy torch pool (child processes)")
    res = oversubscription.under_load(loads=("procs", "torch"), policies=("default",), quick=quick)
    worst = res["worst"].get("default")
    if worst is None:
        return {"skip": "no loaded run finished"}
    per = {f"{load}: {shape}": round(v["ratio"]["mean"], 2)
           for load, pol in res["loads"].items()
           for shape, v in pol.get("default", {}).get("shapes", {}).items()}
    return {"impls": {"ours": {"median_s": worst, "min_s": worst, "max_s": worst}},
            "worst": worst, "ratios": per, "others_cpu": None}
