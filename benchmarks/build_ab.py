"""Two builds of lora in one process, call against call: decode (cold and warm), prefill, stacks
and the model sweep.

bench.py times one build against NumPy and PyTorch.  A kernel change moves a row by 5-20 %,
about what this kind of shared VM drifts between two runs, so two bench.py runs cannot tell the
builds apart.  This script loads the build under test (the ``lora`` on ``sys.path``) and
another build of the same package (``--other DIR``: a directory holding a built ``lora``
package, e.g. a ``git worktree`` of an older commit after ``python setup.py build_ext
--inplace``), copied under another package name.  Both get the same weights.  It then times
them in alternating rounds, and prints per row the paired median of new/other with its min-max,
and whether the two builds gave the same bits.

* ``decode``: ``add_to`` on one delta (warm: its factors stay in cache) or on as many deltas as
  make ``--cold-mb`` MB (cold: every call reads its factors from memory, as in a model's decode
  step);
* ``prefill``: ``add_batch_to`` on one delta or a stack;
* ``sweep``: one decode through every projection of ``--layers`` Llama-2-7B layers (rank 16),
  with this machine's DRAM read bandwidth measured alongside (``lora_bench_read``, the same
  reference as bench.py's sweep rows), and a read of the new build's deltas' own storage, delta
  by delta (``lora_bench_read_deltas``).

  python benchmarks/build_ab.py --other /tmp/old [--rounds 15] [--only TEXT] [--quick]

Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, on a quiet machine; docs/performance.md
quotes its output.
"""

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from lorabench.machine import make_deltas_reader, make_reader
from lorabench.workloads.sweep import LLAMA2_7B as SWEEP_PROJECTIONS

LLAMA2_7B = tuple((rows, cols) for _, rows, cols in SWEEP_PROJECTIONS)

# (name, kind, rows, cols, ranks, dtype, batch or mode)
ROWS = [(f"decode {r}x{c} r{k} {dt} {m}", "decode", r, c, [k], dt, m)
        for m in ("cold", "warm") for dt in ("float32", "bfloat16", "q8_0")
        for r, c, k in ((4096, 4096, 8), (4096, 4096, 16), (11008, 4096, 16), (4096, 4096, 64))]
ROWS += [(f"prefill {r}x{c} r{k} {dt} b{n}", "prefill", r, c, [k], dt, n)
         for dt in ("float32", "bfloat16", "q8_0") for r, c, k in ((4096, 4096, 16), (4096, 4096, 64))
         for n in (2, 3, 8, 128, 512)]
ROWS += [(f"stack 4x r16 {dt} b{n}", "prefill", 4096, 4096, [16] * 4, dt, n)
         for dt in ("float32", "bfloat16") for n in (16, 128, 512)]
ROWS += [(f"sweep {dt}", "sweep", 0, 0, [16], dt, None) for dt in ("float32", "bfloat16", "q8_0")]
QUICK = [("decode 256x128 r8 float32 cold", "decode", 256, 128, [8], "float32", "cold"),
         ("decode 256x128 r8 bfloat16 warm", "decode", 256, 128, [8], "bfloat16", "warm"),
         ("stack 2x r8 float32 b9", "prefill", 256, 128, [8, 8], "float32", 9),
         ("sweep float32", "sweep", 0, 0, [4], "float32", None)]


def load_other(path):
    """The build in path/lora, imported as package ``lora_other`` from a private copy."""
    src = os.path.join(path, "lora")
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        sys.exit(f"--other {path!r}: no lora package there (expected {src}/__init__.py)")
    tmp = tempfile.mkdtemp(prefix="lora_build_ab_")
    shutil.copytree(src, os.path.join(tmp, "lora_other"), ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, tmp)
    # an extension module registers itself under the name it was built with: the copy's
    # _lora_cffi and _edge replace lora's own in sys.modules, so that a later
    # `from lora._lora_cffi import lib` would get the other build's; put lora's back
    ours = {k: v for k, v in sys.modules.items() if k == "lora" or k.startswith("lora.")}
    other = importlib.import_module("lora_other")
    for k in [k for k in sys.modules if k.startswith("lora.") and k not in ours]:
        del sys.modules[k]
    sys.modules.update(ours)
    return other, tmp


def weights(rng, rows, cols, rank):
    return ((rng.standard_normal((rank, cols)) * 1.7 / np.sqrt(cols)).astype(np.float32),
            (rng.standard_normal((rows, rank)) * 0.02).astype(np.float32))


def entry(lib, pairs, dt):
    ds = [lib.LoraDelta(a, b, alpha=2.0 * a.shape[0], dtype=dt) for a, b in pairs]
    return ds[0] if len(ds) == 1 else lib.LoraStack(ds)


def build(libs, row, args):
    """{build: [(fn, x, out), ...]} for one pass of the row (the same weights for both builds),
    the passes a timed sample repeats, a one-line description, and the bytes of factors a pass
    reads (the sweep's; None for the other rows)."""
    name, kind, rows, cols, ranks, dt, extra = row
    rng = np.random.default_rng(7)
    w = 4 if dt == "float32" else 2
    if kind == "sweep":
        layers = args.layers if not args.quick else 2
        shapes = [(r, c) for _ in range(layers) for r, c in (LLAMA2_7B if not args.quick
                                                             else ((256, 128), (128, 256)))]
        pairs = [weights(rng, r, c, ranks[0]) for r, c in shapes]
        xs = {c: rng.standard_normal(c).astype(np.float32) for _, c in shapes}
        calls = {}
        for key, lib in libs.items():
            outs = {r: np.zeros(r, np.float32) for r, _ in shapes}
            calls[key] = [(entry(lib, [p], dt).add_to, xs[c], outs[r]) for p, (r, c) in zip(pairs, shapes)]
        nbytes = sum(fn.__self__.resident_bytes for fn, _, _ in calls["new"])
        return calls, 1, f"{len(shapes)} decodes, {nbytes / 2**20:.0f} MiB of factors", nbytes
    if kind == "decode":
        per = sum(ranks) * (rows + cols) * w
        cold_mb = 4.0 if args.quick else args.cold_mb
        n = 1 if extra == "warm" else max(4, int(cold_mb * 1e6 // per))
        pairs = [weights(rng, rows, cols, ranks[0]) for _ in range(n)]
        x = rng.standard_normal(cols).astype(np.float32)
        calls = {key: [(entry(lib, [p], dt).add_to, x, np.zeros(rows, np.float32)) for p in pairs]
                 for key, lib in libs.items()}
        reps = max(1, int(2e-3 / max(per / 50e9, 1e-7))) if extra == "warm" else 1
        return calls, reps, f"{n} delta(s), {n * per / 2**20:.1f} MiB", None
    pairs = [weights(rng, rows, cols, k) for k in ranks]
    x = rng.standard_normal((extra, cols)).astype(np.float32)
    calls = {key: [(entry(lib, pairs, dt).add_batch_to, x, np.zeros((extra, rows), np.float32))]
             for key, lib in libs.items()}
    macs = extra * sum(ranks) * (rows + cols)
    return calls, max(1, int(20e6 // macs)), f"{macs / 1e6:.0f} M multiply-adds", None


def same_bits(calls):
    """Whether the first call of the pass gives the same bits under both builds."""
    got = []
    for key in ("new", "other"):
        fn, x, out = calls[key][0]
        o = np.zeros_like(out)
        fn(x, o)
        got.append(o)
    return np.array_equal(got[0], got[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="a directory holding another built lora package")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--only", action="append", default=[], help="rows whose name contains TEXT")
    ap.add_argument("--cold-mb", type=float, default=300.0, help="factors a cold decode row reads per pass")
    ap.add_argument("--layers", type=int, default=32, help="Llama-2-7B layers of the sweep")
    ap.add_argument("--quick", action="store_true", help="tiny rows, two rounds (a smoke run)")
    args = ap.parse_args()
    import lora

    other, tmp = load_other(args.other)
    try:
        libs = {"new": lora, "other": other}
        rows = QUICK if args.quick else ROWS
        rows = [r for r in rows if not args.only or any(t in r[0] for t in args.only)]
        rounds = 2 if args.quick else args.rounds
        buf = np.ones((8 if args.quick else 256) << 20 >> 2, np.float32)
        dram_read = make_reader(buf, lora.get_num_threads())
        print(f"new: {os.path.dirname(lora.__file__)}; other: {args.other}; {rounds} rounds; "
              f"ISA {lora.kernel_info()['isa']}, {lora.get_num_threads()} threads"
              + ("; --quick: a smoke run, its sizes too small for its times to mean anything"
                 if args.quick else ""))
        for row in rows:
            calls, reps, what, nbytes = build(libs, row, args)
            samples = 3 if row[1] == "prefill" or row[6] == "warm" else 1  # cold: one pass
            bits = same_bits(calls)
            times = {"new": [], "other": []}
            dram, stored = [], []
            if row[1] == "sweep":  # the new build's deltas' own storage, read as the calls meet it
                stored_read = make_deltas_reader([fn.__self__ for fn, _, _ in calls["new"]],
                                                 lora.get_num_threads())
            for r in range(rounds):
                if row[1] == "sweep":
                    dram.append(buf.nbytes / dram_read.run(1) / 1e9)
                    # both cold; the first may also pay for waking the team
                    stored.append(min(stored_read.run(1) for _ in range(2)))
                for key in (("new", "other") if r % 2 == 0 else ("other", "new")):
                    for fn, x, out in calls[key][:1]:
                        fn(x, out)  # this build's code and x in cache; a cold row's factors are not
                    best = float("inf")
                    for _ in range(samples):
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            for fn, x, out in calls[key]:
                                fn(x, out)
                        best = min(best, (time.perf_counter() - t0) / reps / len(calls[key]))
                    times[key].append(best)
            ratios = sorted(a / b for a, b in zip(times["new"], times["other"]))
            new_t, other_t = statistics.median(times["new"]), statistics.median(times["other"])
            line = (f"{row[0]:34s} new {new_t * 1e6:10.2f} us  other {other_t * 1e6:10.2f} us  "
                    f"new/other {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})  "
                    f"bits {'equal' if bits else 'DIFFER'}  [{what}]")
            if dram:  # the sweep: its factors' bytes over a pass's time, against the DRAM read
                bw, n = statistics.median(dram), len(calls["new"])
                line += (f"\n{'':34s} DRAM read alongside {bw:.1f} GB/s ({min(dram):.1f}-{max(dram):.1f}); "
                         f"factors read at {nbytes / (new_t * n) / 1e9 / bw:.2f} of it (new), "
                         f"{nbytes / (other_t * n) / 1e9 / bw:.2f} (other)")
                read_t = statistics.median(stored)
                sb = stored_read.keep.nbytes / read_t / 1e9
                line += (f"\n{'':34s} the new deltas' storage read delta by delta (no arithmetic) "
                         f"{sb:.1f} GB/s = {sb / bw:.2f} of the DRAM read, taking "
                         f"{read_t / (new_t * n):.2f} of new's time")
            print(line, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
