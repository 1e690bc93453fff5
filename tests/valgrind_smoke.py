"""Touch every public function of `lora` once, small, and check the answers.

Not a pytest module (no ``test_`` prefix): a standalone script for the memory checkers.

- ``.ci/valgrind.sh`` runs it under ``valgrind --tool=memcheck`` with ``LORA_ISA=scalar`` and
  ``LORA_ISA=avx2`` (valgrind cannot execute AVX-512, so that path is covered by the sanitizer
  build instead).
- ``.ci/sanitize.sh`` runs it in the ASan+UBSan build once per ISA this CPU supports, since the
  pytest suite runs only the best path by default.

Sizes straddle the register widths (1, 7, 15, 16, 17, 31, 32, 33 and an odd larger one) so every
masked / scalar tail is executed, for each storage dtype; a few shapes are large enough to open an
OpenMP team, so the threaded runners run too.  Every result is compared against a float64 NumPy
reference, so a kernel that reads the wrong bytes fails here even when no checker notices.

Usage: ``python tests/valgrind_smoke.py [--quick]``; exits 0 when every check passed and prints the
ISA in use (``LORA_ISA`` selects it; the script fails if the request was not honoured).
"""

import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

import lora

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SIZES = (1, 7, 15, 16, 17, 31, 32, 33, 67)
DTYPES = ("float32", "float16", "bfloat16")
checks = 0


def check(cond, what):
    global checks
    checks += 1
    if not cond:
        raise AssertionError(what)


def close(got, want, what, rtol=2e-3, atol=1e-4):
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) if np.size(want) else 0.0
    bound = atol + rtol * (np.max(np.abs(want)) if np.size(want) else 0.0)
    check(err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}")


def stored(d):
    a, b = d.lora_weights()
    return a.astype(np.float64), b.astype(np.float64)


def ref_add(d, x):
    a, b = stored(d)
    return d.effective_scale * (np.asarray(x, np.float64) @ a.T) @ b.T


def ref_rows(d, ids):
    a, b = stored(d)
    return d.effective_scale * b[np.asarray(ids)] @ a


def exercise_delta(rng, rank, rows, cols, dtype, batch=5):
    a = rng.standard_normal((rank, cols)).astype(np.float32)
    b = rng.standard_normal((rows, rank)).astype(np.float32)
    d = lora.LoraDelta(a, b, alpha=2.0 * rank, dtype=dtype, base_shape=(rows, cols))
    tag = f"{dtype} r{rank} [{rows}x{cols}]"
    # decode
    x = rng.standard_normal(cols).astype(np.float32)
    out = rng.standard_normal(rows).astype(np.float32)
    want = out + ref_add(d, x)
    close(d.add_to(x, out), want, f"add_to {tag}")
    # prefill, C-contiguous and into a row-strided view of a wider buffer (fused qkv)
    xb = rng.standard_normal((batch, cols)).astype(np.float32)
    wide = rng.standard_normal((batch, rows + 3)).astype(np.float32)
    view = wide[:, 1:1 + rows]
    want = view + ref_add(d, xb)
    close(d.add_batch_to(xb, view), want, f"add_batch_to strided {tag}")
    check(np.all(np.isfinite(wide[:, 0])) and np.all(np.isfinite(wide[:, -2:])), "neighbours")
    # x as float64 and as a strided view: the converting path
    xs = np.repeat(xb.astype(np.float64), 2, axis=1)[:, ::2]
    outb = np.zeros((batch, rows), np.float32)
    close(d.add_batch_to(xs, outb), ref_add(d, xb), f"add_batch_to f64 strided x {tag}")
    # gathers
    r = rows - 1
    row = np.zeros(cols, np.float32)
    close(d.add_row_to(r, row), ref_rows(d, [r])[0], f"add_row_to {tag}")
    ids = rng.integers(0, rows, size=batch)
    outr = np.zeros((batch, cols + 2), np.float32)[:, :cols]
    close(d.add_rows_to(ids, outr), ref_rows(d, ids), f"add_rows_to {tag}")
    return d


def exercise_errors(rng):
    d = lora.LoraDelta(np.ones((3, 5), np.float32), np.ones((4, 3), np.float32))
    out = np.zeros((2, 5), np.float32)
    before = out.copy()
    for bad_ids, exc in (([0, 4], IndexError), ([-1, 0], IndexError), ([0.0, 1.0], TypeError)):
        try:
            d.add_rows_to(bad_ids, out)
        except exc:
            checks_ok = True
        else:
            checks_ok = False
        check(checks_ok and np.array_equal(out, before), f"add_rows_to({bad_ids}) error path")
    buf = np.zeros(16, np.float32)
    try:
        d.add_to(buf[:5], buf[3:7])  # x and out overlap
    except ValueError:
        check(True, "overlap")
    else:
        check(False, "overlapping x/out must be a ValueError")
    for bad in (lambda: lora.LoraDelta(np.ones((3, 5)), np.ones((4, 2))),
                lambda: lora.LoraDelta.from_flat(np.ones(14), np.ones(12), 3, 4, 5),
                lambda: lora.LoraDelta(np.array([[np.inf]]), np.ones((1, 1))),
                lambda: lora.LoraDelta(np.full((1, 1), 1e6), np.ones((1, 1)), dtype="float16")):
        try:
            with warnings.catch_warnings():  # NumPy warns about the float16 overflow it reports
                warnings.simplefilter("ignore", RuntimeWarning)
                bad()
        except ValueError:
            check(True, "constructor error")
        else:
            check(False, "a bad pair must raise")
    try:
        lora.LoraBank([d, None]).add_batch_to(np.ones((2, 5), np.float32),
                                               np.zeros((2, 4), np.float32), [0, 2])
    except IndexError:
        check(True, "adapter id")
    else:
        check(False, "adapter id 2 of 2 entries must raise")


def exercise_combined(rng, dtype):
    rows, cols = 33, 17
    mk = lambda rank, alpha: lora.LoraDelta(  # noqa: E731
        rng.standard_normal((rank, cols)), rng.standard_normal((rows, rank)), alpha=alpha,
        dtype=dtype)
    d1, d2, d3 = mk(4, 8.0), mk(7, 0.0), mk(16, 3.0)
    shared = lora.LoraScale(0.5)
    d4 = lora.LoraDelta.from_flat(rng.standard_normal(2 * cols), rng.standard_normal(rows * 2),
                                  2, rows, cols, alpha=1.0, scale=shared, rslora=True, dtype=dtype)
    check(d4.scale is shared and d4.rslora and d4.resident_bytes > 0, "from_flat attributes")
    repr(d4), d4.base_shape, d4.alpha, d4.rank, d4.rows, d4.cols, d4.dtype
    stack = lora.LoraStack([d1])
    stack.append(d2)
    stack.append(d4)
    check(len(stack) == 3 and stack[0] is d1 and list(stack)[2] is d4, "stack container")
    repr(stack), stack.base_shape, stack.rows, stack.cols, stack.resident_bytes
    x = rng.standard_normal((6, cols)).astype(np.float32)
    want = sum(ref_add(d, x) for d in stack)
    close(stack.add_batch_to(x, np.zeros((6, rows), np.float32)), want, f"stack batch {dtype}")
    close(stack.add_to(x[0], np.zeros(rows, np.float32)), want[0], f"stack decode {dtype}")
    ids = np.array([0, rows - 1, 5, 5])
    want_rows = sum(ref_rows(d, ids) for d in stack)
    close(stack.add_rows_to(ids, np.zeros((4, cols), np.float32)), want_rows, "stack rows")
    close(stack.add_row_to(3, np.zeros(cols, np.float32)), sum(ref_rows(d, [3])[0] for d in stack),
          "stack row")
    # an empty stack adds nothing
    empty = lora.LoraStack()
    z = np.zeros((2, 3), np.float32)
    check(np.array_equal(empty.add_batch_to(np.ones((2, 4)), z), np.zeros((2, 3))), "empty stack")
    empty.add_to(np.ones(4), np.zeros(3, np.float32))
    empty.add_row_to(0, np.zeros(3, np.float32))
    empty.add_rows_to([0, 1], z)
    # offline ops
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w0 = w.copy()
    close(d1.delta_weight(), d1.effective_scale * stored(d1)[1] @ stored(d1)[0], "delta_weight")
    d1.merge_into(w)
    d1.unmerge_from(w)
    close(w, w0, "merge/unmerge")
    wt = np.ascontiguousarray(w.T).T  # fan_in_fan_out base: a transposed view
    stack.merge_into(wt)
    stack.unmerge_from(wt)
    close(wt, w0, "stack merge/unmerge (transposed base)")
    close(stack.delta_weight(), sum(d.delta_weight().astype(np.float64) for d in stack),
          "stack delta_weight")
    # bank: mixed entries, -1, None, a stack entry
    bank = lora.LoraBank([d1, None, stack, d3])
    check(len(bank) == 4 and bank[2] is stack and bank.base_shape == (rows, cols), "bank container")
    repr(bank), list(bank), bank.resident_bytes
    aid = np.array([3, -1, 0, 2, 1, 0, 3, 2, 2])
    xb = rng.standard_normal((len(aid), cols)).astype(np.float32)
    entries = [d1, None, stack, d3]

    def entry_ref(e, fn, n):
        if e is None:
            return np.zeros(n)
        return sum(fn(d) for d in (e if isinstance(e, lora.LoraStack) else [e]))

    want = np.stack([entry_ref(entries[i], lambda d, b=b: ref_add(d, xb[b]), rows) if i >= 0
                     else np.zeros(rows) for b, i in enumerate(aid)])
    close(bank.add_batch_to(xb, np.zeros((len(aid), rows), np.float32), aid), want, "bank batch")
    tok = rng.integers(0, rows, size=len(aid))
    want = np.stack([entry_ref(entries[i], lambda d, b=b: ref_rows(d, [tok[b]])[0], cols) if i >= 0
                     else np.zeros(cols) for b, i in enumerate(aid)])
    close(bank.add_rows_to(tok, np.zeros((len(aid), cols), np.float32), aid), want, "bank rows")
    nobank = lora.LoraBank([None, None])
    nobank.add_batch_to(np.ones((2, 3), np.float32), np.zeros((2, 4), np.float32), [0, -1])
    nobank.add_rows_to([0, 1], np.zeros((2, 3), np.float32), [1, -1])
    # the scale: shared, read per call, 0 skips
    shared.set(0.0)
    out = np.ones(rows, np.float32)
    d4.add_to(x[0], out)
    check(np.array_equal(out, np.ones(rows, np.float32)), "scale 0 leaves out untouched")
    shared.value = 2.0
    check(shared.get() == 2.0 and float(shared) == 2.0 and "2.0" in repr(shared), "LoraScale")


def exercise_threads(rng):
    """Shapes above the OpenMP work threshold, on 1 and on all threads: identical bits."""
    info = lora.kernel_info()
    check(set(info) >= {"isa", "available_isas", "openmp", "threads", "compiler", "version"},
          "kernel_info keys")
    n0 = lora.get_num_threads()
    d = lora.LoraDelta(rng.standard_normal((16, 1031)), rng.standard_normal((1029, 16)))
    x = rng.standard_normal((9, 1031)).astype(np.float32)
    ids = rng.integers(0, 1029, size=9)
    results = []
    for n in (1, max(2, n0)):
        lora.set_num_threads(n)
        results.append((d.add_batch_to(x, np.zeros((9, 1029), np.float32)),
                        d.add_to(x[0], np.zeros(1029, np.float32)),
                        d.add_rows_to(ids, np.zeros((9, 1031), np.float32))))
    lora.set_num_threads(1 << 20)
    check(all(np.array_equal(p, q) for p, q in zip(*results)), "thread-count invariance")
    close(results[0][0], ref_add(d, x), "threaded batch")


def exercise_heap_paths(rng):
    """The runners' heap fallbacks: rank above the on-stack scratch (512), a bank plan above its
    on-stack size (256 positions, 16 entries), and the by-block threaded path (many blocks)."""
    lora.set_num_threads(1 << 20)
    d = lora.LoraDelta(rng.standard_normal((600, 17)), rng.standard_normal((33, 600)),
                       dtype="float16")
    x = rng.standard_normal((9, 17)).astype(np.float32)
    close(d.add_batch_to(x, np.zeros((9, 33), np.float32)), ref_add(d, x), "rank 600 batch")
    close(d.add_to(x[0], np.zeros(33, np.float32)), ref_add(d, x[0]), "rank 600 decode")
    ids = rng.integers(0, 33, size=9)
    close(d.add_rows_to(ids, np.zeros((9, 17), np.float32)), ref_rows(d, ids), "rank 600 rows")
    entries = [lora.LoraDelta(rng.standard_normal((1 + i % 5, 17)),
                              rng.standard_normal((33, 1 + i % 5))) for i in range(20)]
    bank = lora.LoraBank(entries + [None])
    aid = rng.integers(-1, len(entries) + 1, size=301)
    xb = rng.standard_normal((301, 17)).astype(np.float32)
    want = np.stack([ref_add(entries[i], xb[b]) if 0 <= i < len(entries) else np.zeros(33)
                     for b, i in enumerate(aid)])
    close(bank.add_batch_to(xb, np.zeros((301, 33), np.float32), aid), want, "bank of 301")
    tok = rng.integers(0, 33, size=301)
    want = np.stack([ref_rows(entries[i], [tok[b]])[0] if 0 <= i < len(entries) else np.zeros(17)
                     for b, i in enumerate(aid)])
    close(bank.add_rows_to(tok, np.zeros((301, 17), np.float32), aid), want, "bank rows of 301")
    big = lora.LoraDelta(rng.standard_normal((16, 1031)), rng.standard_normal((515, 16)))
    xs = rng.standard_normal((41, 1031)).astype(np.float32)  # 11 blocks: threads take blocks
    close(big.add_batch_to(xs, np.zeros((41, 515), np.float32)), ref_add(big, xs), "by-block")


def exercise_loaders():
    """load_peft / load_gguf on the upstream fixtures, when the loaders are present."""
    if not hasattr(lora, "load_peft"):
        print("loaders: lora.load_peft not present yet; skipped")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = lora.load_peft(FIXTURES / "peft_r8_alpha16")
        gg = lora.load_gguf(FIXTURES / "gguf" / "lora_r8_alpha16_f32.gguf")
    for ad in (peft, gg):
        repr(ad), ad.name, ad.alpha, ad.dtype, ad.resident_bytes
        name, d = next(iter(ad.items()))
        ad.check_base({k: v.base_shape for k, v in ad.items()})
        d.add_to(np.ones(d.cols, np.float32), np.zeros(d.rows, np.float32))
    # the command line, in process: info, inspect of both formats, a bad file (exit 2)
    import io

    from lora.__main__ import main as cli

    sink = io.StringIO()
    check(cli(["info"], out=sink, err=sink) == 0, "python -m lora info")
    for path in (FIXTURES / "peft_r8_alpha16", FIXTURES / "gguf" / "lora_r8_alpha16_f32.gguf"):
        check(cli(["inspect", str(path)], out=sink, err=sink) == 0, f"inspect {path.name}")
    check(cli(["inspect", str(FIXTURES / "README.md")], out=sink, err=sink) == 2, "inspect bad")
    # a truncated copy must be refused cleanly
    with tempfile.TemporaryDirectory() as tmp:
        src = (FIXTURES / "gguf" / "lora_r8_alpha16_f32.gguf").read_bytes()
        bad = Path(tmp) / "cut.gguf"
        bad.write_bytes(src[: len(src) // 2])
        try:
            lora.load_gguf(bad)
        except lora.LoraFormatError:
            check(True, "truncated gguf")
        else:
            check(False, "a truncated GGUF must raise LoraFormatError")


def main(argv):
    quick = "--quick" in argv
    want_isa = os.environ.get("LORA_ISA", "").strip().lower()
    isa = lora.kernel_info()["isa"]
    if want_isa and want_isa != isa:
        print(f"LORA_ISA={want_isa} requested but the extension runs {isa} "
              f"(available here: {lora.kernel_info()['available_isas']})", file=sys.stderr)
        return 3
    rng = np.random.default_rng(7)
    sizes = (1, 16, 17, 33) if quick else SIZES
    for dtype in DTYPES:
        for n in sizes:
            exercise_delta(rng, rank=n, rows=33, cols=17, dtype=dtype)
            exercise_delta(rng, rank=5, rows=n, cols=n + 1, dtype=dtype)
        exercise_combined(rng, dtype)
    exercise_errors(rng)
    exercise_threads(rng)
    exercise_heap_paths(rng)
    exercise_loaders()
    print(f"valgrind_smoke: isa={isa} threads={lora.get_num_threads()} checks={checks} ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
