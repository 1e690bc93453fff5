"""The command line: parse the flags, probe the machine, run the rows, print and write the report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import numpy as np

from . import isacompare, machine, peftmodel, report, targets, teamcompare, workloads
from .workloads import dorapeft, moepeft, vllmrows
from .timing import TimingConfig

REEXEC_NOTE = "LORA_BENCH_CLEARED"  # set by bench.py when it re-executed without OpenBLAS overrides


def parse_args(argv, description):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every code path, fewer repeats (CI)")
    p.add_argument("--threads", type=int, default=None, help="threads for lora, NumPy's BLAS and torch "
                   "(default: the CPUs this process may use)")
    p.add_argument("--json", metavar="PATH", help="write every number to PATH")
    p.add_argument("--plot", metavar="PATH", help="write a picture (PNG/SVG/PDF, by extension) to PATH")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    p.add_argument("--only", metavar="TEXT", action="append",
                   help="run only workloads whose name or group contains TEXT (repeatable)")
    p.add_argument("--rounds", type=int, help="rounds over the implementations (default 5; quick 1)")
    p.add_argument("--samples", type=int, help="samples per implementation and round (default 5; quick 3)")
    p.add_argument("--min-sample-ms", type=float, help="shortest sample (default 1 ms; quick 0.3 ms)")
    p.add_argument("--settle-ms", type=float, help="idle time before each timed block (default 200; quick 150)")
    p.add_argument("--sweep-layers", type=int, help="layers of the model sweep (default: enough for its "
                   "q8_0 adapters (the smallest) to be 2x the last-level cache, at least 32)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="on a shared machine: before each workload wait up to S seconds for other "
                   "processes to go idle, and measure a timed block again (up to 3 times, after "
                   "waiting up to S seconds) when they were busy during it")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.add_argument("--isa-compare", action="store_true",
                   help="time a few rows under every ISA path this CPU runs and print the CPU table "
                   "row (csrc/isa.c) the run suggests; about a minute (lorabench/isacompare.py)")
    p.add_argument("--team-compare", action="store_true",
                   help="time decodes that fit one core's L2 on one thread and on two and print "
                   "the team floor (team_floor_log2 of csrc/isa.c's CPU table) the run suggests; "
                   "about a minute (lorabench/teamcompare.py)")
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


COLUMNS_NOTE = [
    "columns: ours = end to end through the Python API; GB/s, GFLOP/s from the bytes/flops model (see",
    "  lorabench/workloads/); level = where the working set lives; %roof = roofline bound / measured median;",
    "  vs X = X's median / ours (> 1: lora is faster). Half-precision rows: naive/tuned are the NumPy float32",
    "  baselines of the same shape; torch stores the adapters in the same half dtype; torch f32 is the float32",
    "  torch row (a user who upcasts the adapters once).",
  "  x/out rows: bf16 adapters on bf16 activations (NumPy ml_dtypes arrays or torch tensors); torch = PyTorch",
  "  in bf16 by hand; PEFT = its float32 upcast; naive/tuned and vs ours f32 = the float32 row of that shape.",
  "  edge rows: calls at scale 0 (no arithmetic): the Python layer and the C entry alone. adapter-set step:",
  "  one decode step, a bank call per projection; its edge is the same step with every adapter's scale 0.",
  "  peft rows: one forward of a whole PEFT model (lorabench/peftmodel.py); ours = under lora.accelerate_peft;",
  "  LoRA overhead = a time less the floor's: the same model with its adapter layers disabled (same tensors).",
  "  peft moe rows: a Qwen3-MoE with LoRA on attention and experts (lorabench/workloads/moepeft.py); floor =",
  "  adapter layers disabled under accelerate_peft (our experts forward); transformers' = the same under PEFT.",
  "  peft dora rows: the peft rows' Llama with DoRA and plain adapters (lorabench/workloads/dorapeft.py);",
  "  ours / PEFT on DoRA d0, plain = the plain adapter p0; the mixed batch mixes both kinds (ours only).",
  "  vllm rows: vLLM's CPU LoRA methods (lorabench/workloads/vllmrows.py): ours = lora.vllm.PunicaWrapper,",
  "  stock = vLLM's PunicaWrapperCPU, grouped torch = index_select + matmul per slot; vllm serve rows: whole",
  "  LLM.generate runs, one engine with each wrapper; x (a) = the row's time over (a)'s with the same wrapper.",
]


def main(argv=None, description=None):
    args = parse_args(argv, description)
    if args.isa_compare:
        return isacompare.run(args)
    if args.team_compare:
        return teamcompare.run(args)
    quick = args.quick
    t_start = time.monotonic()
    cpu = machine.cpu_info()
    threads = args.threads or cpu["usable_cpus"] or 1
    cfg = TimingConfig(
        min_sample_s=(args.min_sample_ms or (0.3 if quick else 1.0)) * 1e-3,
        samples=args.samples or (3 if quick else 5),
        rounds=args.rounds or (1 if quick else 5),
        impl_budget_s=0.15 if quick else 0.6,
        settle_s=(args.settle_ms if args.settle_ms is not None else 150 if quick else 200) * 1e-3,
        quiet_wait_s=args.wait_quiet,
        tick_retries=1 if quick else 3,  # a busy machine would make --quick's every block thrice
    )
    sweep_layers, sizing = workloads.size_sweep(cpu["llc"]["bytes"], cpu["mem_available_bytes"],
                                                 args.sweep_layers, quick)
    notes = []

    lora = machine.import_lora()
    torch, why = machine.import_torch(args.no_torch)
    if why:
        notes.append(why)

    from threadpoolctl import threadpool_limits

    limiter = threadpool_limits(limits=threads)  # BLAS and OpenMP pools, for the whole run
    lora.set_num_threads(threads)
    if torch is not None:
        torch.set_num_threads(threads)
    blas = machine.blas_pools()
    kinfo = dict(lora.kernel_info())
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None, "quick": quick, "cpu": cpu,
        "lora": kinfo, "lora_path": os.path.dirname(lora.__file__), "threads": threads,
        "lora_threads": lora.get_num_threads(), "blas_threads": ", ".join(str(b.get("num_threads")) for b in blas) or "-",
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "blas": blas, "openblas_cleared": os.environ.get(REEXEC_NOTE),
        "timing": cfg.__dict__, "sweep_layers": sweep_layers, "sweep_sizing": sizing,
        "bw_trials": 3 if quick else 6,
    }
    if meta["lora_threads"] != threads:
        notes.append(f"lora runs {meta['lora_threads']} threads, not the {threads} asked for "
                     f"(kernel_info: openmp {kinfo.get('openmp')})")

    set_layers, set_sizing = workloads.size_set_step(cpu["llc"]["bytes"], cpu["mem_available_bytes"], quick)
    meta["set_step_sizing"] = set_sizing
    if quick:
        notes.append(f"--quick: the adapter-set step builds {set_layers} layers (a full run sizes it "
                     f"from the last-level cache, at least the model's {workloads.LLAMA2_7B_LAYERS})")
    elif set_sizing["capped_by"]:
        notes.append(f"the adapter-set step builds {set_layers} layers, capped by {set_sizing['capped_by']} "
                     f"({set_sizing['layers_wanted']} would read 2x the last-level cache)")
    peft_layers = peftmodel.QUICK_LAYERS if quick else peftmodel.LAYERS
    if quick:
        notes.append(f"--quick: the PEFT rows build {peft_layers} of their model's {peftmodel.LAYERS} layers "
                     "(a full run builds them all)")
    W = workloads.workloads(sweep_layers, startup_runs=5 if quick else 11, set_layers=set_layers,
                            quick=quick)
    W += peftmodel.workloads(peft_layers)
    W += moepeft.workloads(quick)
    W += vllmrows.workloads(quick)
    W += dorapeft.workloads(quick)
    if args.only:
        W = [w for w in W if any(t in f"{w.name} {w.group} {w.dtype}" for t in args.only)]
    progress = report.Progress(len(W) + 2, enabled=not args.no_progress)
    failures = 0

    monitor, run_monitor = machine.CpuMonitor(), machine.CpuMonitor()
    load = meta["load"] = {"loadavg_start": machine.loadavg()}
    time.sleep(0.5)
    busy = load["others_cpu_at_start"] = meta["others_cpu_at_start"] = monitor.others()
    if busy is not None and busy > 0.2:
        notes.append(f"the machine was busy at start: other processes used {busy:.1f} CPUs; "
                     "multi-threaded timings will be noisy (rows marked !)")

    def bandwidth(when):
        progress.step(f"bandwidth ({when})")
        if args.wait_quiet:
            monitor.wait_quiet(args.wait_quiet, progress.status)
        try:
            return machine.measure_bandwidth(threads, cpu["caches"], meta["bw_trials"], progress.status, monitor,
                                             args.wait_quiet)
        except Exception as e:
            notes.append(f"ERROR: bandwidth measurement ({when}) failed ({type(e).__name__}: {e})")
            traceback.print_exc()
            return None, None, None

    bw, dram_reader, bw_busy = bandwidth("start")
    ctx = workloads.Ctx(lora, torch, np.random.default_rng(0), dram_reader, threads)
    for w in W:
        progress.step(targets.label(w))
        try:
            if args.wait_quiet:
                monitor.wait_quiet(args.wait_quiet, progress.status)
            w.result = workloads.run_workload(w, ctx, cfg, progress.status, monitor)
            w.result["torch_used"] = torch is not None
        except workloads.Skip as e:
            w.result = {"skip": str(e)}
        except Exception as e:
            failures += 1
            w.result = {"error": f"{type(e).__name__}: {e}"}
            print(f"\nbench: {w.name} {w.dtype} failed:", file=sys.stderr)
            traceback.print_exc()
        if w.group == "sweep" and w.dtype == "bfloat16":
            ctx.cache.clear()  # the last user of the sweep's source arrays
    ctx.dram_reader = dram_reader = None
    # measured again at the end
    bw_end, _, bw_end_busy = bandwidth("end")
    # each figure is kept from the better of the two measurements: noise only ever lowers one
    peaks = [b.pop("peak")["flops_per_s"] for b in (bw, bw_end) if b]
    if bw and bw_end:
        for lv in bw:
            if bw_end[lv]["bytes_per_s"] > bw[lv]["bytes_per_s"]:
                bw[lv] = bw_end[lv]
    bw = bw or bw_end
    if bw is None:
        failures += 1
    busy = [b for b in (bw_busy, bw_end_busy) if b is not None]
    load["others_cpu_bandwidth"] = max(busy) if busy else None
    load["others_cpu_run"] = run_monitor.others()
    load["loadavg_end"] = machine.loadavg()
    meta["bandwidth"] = bw
    meta["peak_flops_nominal"] = machine.peak_flops(threads, cpu.get("mhz"), kinfo.get("isa"))
    meta["peak_flops"] = max(peaks) if peaks else meta["peak_flops_nominal"]
    meta["peak_measured"] = bool(peaks)
    progress.done()
    limiter.restore_original_limits()
    by_key = {}
    for w in W:
        if "impls" in w.result and w.group not in ("startup", "load"):
            workloads.analyse(w, w.result, bw, meta["peak_flops"], threads, cpu["caches"], by_key)
        if w.dtype == "float32":
            by_key[w.key] = w
        elif w.dtype == "bfloat16":  # the twin a q8_0 row is measured against
            by_key[(w.key, w.dtype)] = w
        same, dram = w.result.get("same_size_read_bytes_per_s"), w.result.get("dram_now_bytes_per_s")
        if same and dram and same > 1.25 * dram:  # the sizing trusted a cache size the machine belies
            notes.append(f"{targets.label(w)}: a read of its {machine.fmt_bytes(w.result['bytes'])} ran at "
                         f"{same / 1e9:.1f} GB/s, {same / dram:.1f}x the DRAM figure: part of it may live in a "
                         f"cache larger than the {machine.fmt_bytes(cpu['llc']['bytes'])} reported "
                         "(a larger --sweep-layers tells)")

    results = targets.evaluate_all(W, {"bw": bw, "llc_bytes": cpu["llc"]["bytes"]})
    meta["elapsed_s"] = time.monotonic() - t_start
    out = report.header_lines(meta) + [""] + report.table_lines(W) + [""] + COLUMNS_NOTE + report.marks_note()
    for section in (report.startup_lines(W), report.baseline_lines(W), report.target_lines(results, quick, bool(args.only)),
                    report.summary_lines(W, meta)):
        out += [""] + section if section else []
    skips = [f"{targets.label(w)}: {w.result['skip']}" for w in W if "skip" in w.result]
    if notes or skips:
        out += ["", "notes:"] + [f"  {n}" for n in notes + skips]
    print("\n".join(out))

    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.json_doc(meta, notes, W, results), f, indent=1, default=str)
    if args.plot:
        try:
            report.plot(args.plot, W, meta)
        except Exception:
            failures += 1
            print("bench: plot failed:", file=sys.stderr)
            traceback.print_exc()
    if failures:
        print(f"bench: {failures} failure(s)", file=sys.stderr)
    return 1 if failures else 0
