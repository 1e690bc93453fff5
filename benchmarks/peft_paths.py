"""accelerate_peft's paths on the PEFT rows' Llama, in one process, step against step.

The PEFT rows of bench.py time whole implementations in interleaved rounds; a change inside
accelerate_peft moves a decode step by less than the step-to-step noise of a shared VM.  This
script alternates single steps of one model instead and reports paired medians (each step's time
less its neighbour's):

* decode b1: the layers' short path in C (``lora._edge.plan_run``) against the same plans run in
  Python;
* mixed b8 (``adapter_names``): the per-composition short paths against the full path at every
  call;
* the decode step's LoRA overhead over the floor (adapter layers disabled): ours, ours with every
  adapter's scale 0 (everything but the kernels' arithmetic and reads), and PEFT's.

  python benchmarks/peft_paths.py [--dtype float32|bfloat16] [--rounds 30] [--layers 8]

Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, on a quiet machine; docs/performance.md
quotes its output.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _NoStore(dict):
    """A layer's mixed-plan dict that keeps nothing: every mixed call takes the full path."""

    def __setitem__(self, key, value):
        pass


def _paired(run, toggle, rounds):
    """Medians of single steps with toggle(True) and toggle(False), and of their differences."""
    times = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            toggle(on)
            run()  # a warm-up step in this state
            t = time.perf_counter_ns()
            run()
            times[on].append(time.perf_counter_ns() - t)
    toggle(True)
    diff = statistics.median(a - b for a, b in zip(times[True], times[False]))
    return statistics.median(times[True]) / 1e6, statistics.median(times[False]) / 1e6, diff / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    import torch
    from peft.tuners.lora import LoraLayer

    import lora
    from lorabench import peftmodel as pm

    class Ctx:
        pass

    ctx = Ctx()
    ctx.torch, ctx.lora, ctx.cache = torch, lora, {}
    m = pm.PeftModels(ctx, args.layers, args.dtype)
    print(f"{args.dtype}, {args.layers} layers, {args.rounds} paired rounds; "
          f"lora isa {lora.kernel_info()['isa']}")

    m.use("ours")
    decode = m.step("decode", m.model)
    decode()
    plans = [layer.plan for layer in m.acc._layers.values() if getattr(layer, "plan", None)]
    c_tuples = [p.c for p in plans]

    def c_plans(on):
        for p, c in zip(plans, c_tuples):
            p.c = c if on else None

    a, b, d = _paired(decode, c_plans, args.rounds)
    print(f"decode b1: plans in C {a:.2f} ms, in Python {b:.2f} ms; paired C - Python {d:+.3f} ms")

    mixed = m.step("mixed", m.model, pm.MIXED)
    mixed()
    layers = [layer for layer in m.acc._layers.values() if hasattr(layer, "mixed")]

    def mixed_plans(on):
        for layer in layers:
            if on and isinstance(layer.mixed, _NoStore):
                layer.mixed = {}
            elif not on:
                layer.mixed = _NoStore()

    a, b, d = _paired(mixed, mixed_plans, args.rounds)
    print(f"mixed b8: plans {a:.2f} ms, full path {b:.2f} ms; paired plans - full {d:+.3f} ms")

    lora_layers = [mod for mod in m.model.modules() if isinstance(mod, LoraLayer)]
    saved = [dict(mod.scaling) for mod in lora_layers]

    def scale0(on):
        for mod, s in zip(lora_layers, saved):
            for k in s:
                mod.scaling[k] = 0.0 if on else s[k]

    times = {"floor": [], "ours": [], "ours, every scale 0": [], "PEFT": []}
    state = {"floor": "peft_base", "PEFT": "peft_unmerged"}
    for _ in range(args.rounds):
        for k in times:
            m.use(state.get(k, "ours"))
            scale0(k == "ours, every scale 0")
            decode()
            t = time.perf_counter_ns()
            decode()
            times[k].append(time.perf_counter_ns() - t)
    scale0(False)
    floor = times["floor"]
    print(f"decode b1 LoRA overhead over the floor ({statistics.median(floor) / 1e6:.2f} ms), "
          "paired medians:")
    for k in ("ours", "ours, every scale 0", "PEFT"):
        over = statistics.median(a - b for a, b in zip(times[k], floor)) / 1e6
        print(f"  {k}: {over:.3f} ms")


if __name__ == "__main__":
    main()
