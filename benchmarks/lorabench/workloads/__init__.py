"""The workloads: what each row computes through the library and through its baselines, its
bytes / flops model, and the list of rows in the order a run measures them (`workloads`).

One module per family, each with its names, sizes, builder and bytes / flops model:

* ``linear``    decode (``add_to``), prefill (``add_batch_to``) and stacks (``LoraStack``);
* ``gather``    token-embedding rows (``add_row_to`` / ``add_rows_to``);
* ``sweep``     one decode token through a Llama-2-7B-shaped model sized to stream from DRAM;
* ``bank``      mixed batches (``LoraBank``), with and without per-position scales;
* ``dora``      DoRA (``DoraDelta.add_batch_to``) against plain LoRA, NumPy and PEFT's formula;
* ``halfact``   bf16 adapters on bf16 activations, NumPy arrays and torch tensors;
* ``edge``      calls at scale 0: the Python layer's time alone;
* ``setstep``   one serving step through an ``AdapterSet`` over every projection;
* ``merge``     ``merge_into`` a torch weight against PyTorch and PEFT;
* ``moe``       routed experts (``LoraExperts.add_to``) at Qwen3-30B-A3B's expert shapes;
* ``moepeft``   a whole Qwen3-MoE PEFT model under ``accelerate_peft`` (rows of the peft group);
* ``load``      under load (``benchmarks/oversubscription.py``); the start-up rows are ``startup``.

Shared: ``core`` (records, operands, the float64 reference, tolerances), ``baselines`` (NumPy
naive, NumPy tuned and PyTorch, written once for every family that runs the plain LoRA product)
and ``runner`` (the check, the timing and the per-row analysis).  Byte counts are the compulsory
traffic of one call; activations and outputs are float32 unless the family says otherwise.
"""

from __future__ import annotations

from .. import startup
from .bank import BANK_BATCHES, BANK_SCALED_BATCHES, bank_name, build_bank
from .core import Built, Ctx, Skip, Workload
from .dora import DORA_BATCHES, build_dora, dora_name
from .edge import BANK_EDGE_NAME, EDGE_ACTS, EDGE_BATCH, EDGE_CALLS, build_bank_edge, build_edge, edge_name
from .gather import GATHER, GATHER_IDS, build_gather, gather_name
from .halfact import HALF_ACT_BATCHES, HALF_ACT_KINDS, build_halfact, halfact_name
from .linear import DECODE_SHAPES, PREFILL_BATCHES, STACK_BATCHES, build_linear, decode_name, prefill_name, stack_name
from .load import LOAD_NAME, measure_under_load
from .merge import MERGE_DTYPES, MERGE_N, QUICK_MERGE_N, build_merge, merge_name
from .moe import MOE_PROJ, MOE_TOKENS, QUICK as QUICK_MOE, build_moe, moe_name
from .runner import analyse, rel_err, run_workload
from .setstep import QUICK_SET_LAYERS, build_set_step, set_step_name, size_set_step
from .sweep import LLAMA2_7B_LAYERS, SWEEP_RANK, build_sweep, size_sweep, sweep_name

__all__ = [  # what the rest of lorabench reads (cli, targets, peftmodel)
    "BANK_EDGE_NAME", "DECODE_SHAPES", "EDGE_BATCH", "LLAMA2_7B_LAYERS", "QUICK_SET_LAYERS", "Built", "Ctx", "Skip",
    "Workload", "analyse", "bank_name", "decode_name", "dora_name", "edge_name", "gather_name", "halfact_name", "moe_name",
    "prefill_name", "rel_err", "run_workload", "size_set_step", "size_sweep", "workloads"]


def workloads(sweep_layers, startup_runs, set_layers=LLAMA2_7B_LAYERS, quick=False):
    """Every row of a run, in the order it is measured."""
    W = [Workload(name, "startup", "-", None, run=lambda ctx, cfg, status, monitor, args=args:
                  startup.measure(ctx.lora, args, startup_runs, status, monitor, cfg.settle_s))
         for name, args in startup.COMMANDS.items()]
    W.append(Workload(LOAD_NAME, "load", "-", None,
                      run=lambda ctx, cfg, status, monitor: measure_under_load(quick, status)))

    def add(name, group, dtype, build, key=""):
        W.append(Workload(name, group, dtype, build, key))

    for dtype in ("float32", "float16", "bfloat16", "q8_0"):
        for rows, cols, r in DECODE_SHAPES:
            key = decode_name(rows, cols, r)
            add(key, "decode", dtype, lambda c, a=(rows, cols, [r], None, dtype): build_linear(c, *a), key)
        for n in PREFILL_BATCHES:
            key = prefill_name(n)
            add(key, "prefill", dtype, lambda c, a=(4096, 4096, [16], n, dtype): build_linear(c, *a), key)
        if dtype == "float32":
            for n in GATHER_IDS:
                add(gather_name(n), "gather", dtype, lambda c, n=n: build_gather(c, *GATHER, n))
            for n in STACK_BATCHES:
                add(stack_name(n), "stack", dtype, lambda c, n=n: build_linear(c, 4096, 4096, [16] * 4, n, "float32"))
        key = sweep_name(sweep_layers)
        add(key, "sweep", dtype, lambda c, d=dtype: build_sweep(c, sweep_layers, SWEEP_RANK, d), key)
    for n in BANK_BATCHES:
        add(bank_name(n), "bank", "float32", lambda c, n=n: build_bank(c, 8, 4096, 4096, 16, n))
    for n in BANK_SCALED_BATCHES:
        add(bank_name(n, True), "bank", "float32", lambda c, n=n: build_bank(c, 8, 4096, 4096, 16, n, True))
    for n in DORA_BATCHES:
        add(dora_name(n), "dora", "float32", lambda c, n=n: build_dora(c, n))
    for kind in HALF_ACT_KINDS:  # bf16 activations; their f32 twins: the decode / prefill rows
        for n in HALF_ACT_BATCHES:
            key = decode_name(4096, 4096, 16) if n is None else prefill_name(n)
            add(halfact_name(n, kind), "halfact", "bfloat16", lambda c, n=n, k=kind: build_halfact(c, n, k), key)
    for method, batch in EDGE_CALLS:
        for act in EDGE_ACTS:
            add(edge_name(method, batch), "edge", act, lambda c, a=(method, act, batch): build_edge(c, *a))
    add(BANK_EDGE_NAME, "edge", "float32", build_bank_edge)
    for dtype in ("bfloat16", "q8_0"):
        add(set_step_name(set_layers), "setstep", dtype, lambda c, d=dtype: build_set_step(c, set_layers, dtype=d),
            set_step_name(set_layers))
    merge_n = QUICK_MERGE_N if quick else MERGE_N
    for wdt in MERGE_DTYPES:
        add(merge_name(merge_n), "merge", wdt, lambda c, w=wdt: build_merge(c, w, merge_n))
    if quick:  # one small routed row: the code path, not the numbers
        q = {k: v for k, v in QUICK_MOE.items() if k not in ("proj", "tokens")}
        add(moe_name(None, None, quick=True), "moe", "float32",
            lambda c: build_moe(c, QUICK_MOE["proj"], QUICK_MOE["tokens"], "float32", **q))
    else:
        for dtype in ("float32", "bfloat16"):
            for tokens in MOE_TOKENS:
                for proj in MOE_PROJ:
                    key = moe_name(proj, tokens)
                    add(key, "moe", dtype, lambda c, a=(proj, tokens, dtype): build_moe(c, *a), key)
    return W
