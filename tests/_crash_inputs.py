"""Feed lora every bad and nasty input we know of, in a child interpreter (run by
test_contract.py::test_bad_inputs_never_crash, once per ISA path via LORA_ISA).

A segfault, abort or hang kills this process and the test sees it.  Every call must either work
or raise one of the documented exception types (TypeError, ValueError incl. LoraShapeError,
IndexError); anything else is printed as "UNEXPECTED <case>: <type> <message>".  A call that
raises must leave `out` untouched ("CHANGED <case>").  The last line is "DONE <cases>".
"""

import sys

import numpy as np

import lora

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

RANK, ROWS, COLS, N = 3, 6, 8, 4
I64_MIN, I64_MAX, U64_MAX = -2**63, 2**63 - 1, 2**64 - 1
OK_TYPES = (TypeError, ValueError, IndexError)

rng = np.random.default_rng(0)
cases = 0
problems = 0


def f32(shape):
    return rng.standard_normal(shape).astype(np.float32)


def attempt(name, fn, *watched):
    global cases, problems
    cases += 1
    snaps = [w.tobytes() if isinstance(w, np.ndarray) else None for w in watched]
    try:
        fn()
    except OK_TYPES:
        for w, s in zip(watched, snaps):
            if s is not None and w.tobytes() != s:
                problems += 1
                print(f"CHANGED {name}", flush=True)
    except Exception as e:  # noqa: BLE001 - reporting, not handling
        problems += 1
        print(f"UNEXPECTED {name}: {type(e).__name__} {e}", flush=True)


def misaligned(shape):
    n = int(np.prod(shape))
    raw = bytearray(4 * n + 1)
    arr = np.frombuffer(raw, dtype=np.float32, count=n, offset=1).reshape(shape)
    return arr


def main():
    s0 = lora.LoraScale(0.0)
    deltas = {
        "f32": lora.LoraDelta(f32((RANK, COLS)), f32((ROWS, RANK)), alpha=4.0),
        "f16": lora.LoraDelta(f32((RANK, COLS)), f32((ROWS, RANK)), dtype="float16"),
        "bf16-scale0": lora.LoraDelta(f32((RANK, COLS)), f32((ROWS, RANK)), dtype="bfloat16",
                                      scale=s0),
    }
    targets = dict(deltas)
    targets["stack"] = lora.LoraStack(list(deltas.values()))
    targets["empty-stack"] = lora.LoraStack()
    bank = lora.LoraBank([deltas["f32"], None, targets["stack"], deltas["bf16-scale0"]])
    none_bank = lora.LoraBank([None, None])
    empty_bank = lora.LoraBank([])

    xs = {
        "int": np.ones(COLS, np.int64), "complex": np.ones(COLS, complex),
        "object": np.array([object()] * COLS), "str": np.array(["a"] * COLS),
        "bool": np.ones(COLS, bool),
        "0-d": np.float32(1.0) + np.zeros((), np.float32), "0-d-int": np.array(3),
        "short": f32(COLS - 1), "long": f32(COLS + 1), "2-d": f32((1, COLS)), "empty": f32(0),
        "big-endian": f32(COLS).astype(">f4"), "float16": f32(COLS).astype(np.float16),
        "bfloat16": f32(COLS).astype(BF16) if BF16 is not None else f32(COLS),
        "broadcast": np.broadcast_to(np.float32(1), (COLS,)), "strided": f32(2 * COLS)[::2],
        "reversed": f32(COLS)[::-1], "misaligned": misaligned(COLS), "nan-inf": np.array(
            [np.nan, np.inf, -np.inf] + [0.0] * (COLS - 3), np.float32),
        "list": [0.5] * COLS, "none": None, "scalar": 1.0, "bytes": b"\0" * 4 * COLS,
        "float128": np.ones(COLS, np.longdouble),
    }
    outs = {
        "float64": np.zeros(ROWS), "int32": np.zeros(ROWS, np.int32),
        "big-endian": np.zeros(ROWS, ">f4"), "0-d": np.zeros((), np.float32),
        "short": np.zeros(ROWS - 1, np.float32), "2-d": np.zeros((1, ROWS), np.float32),
        "strided": np.zeros(2 * ROWS, np.float32)[::2],
        "reversed": np.zeros(ROWS, np.float32)[::-1],
        "broadcast": np.broadcast_to(np.float32(0), (ROWS,)), "list": [0.0] * ROWS, "none": None,
        "misaligned": misaligned(ROWS), "memoryview": memoryview(bytearray(4 * ROWS)),
        "empty": np.zeros(0, np.float32),
    }
    ro = np.zeros(ROWS, np.float32)
    ro.flags.writeable = False
    outs["read-only"] = ro

    for tname, t in targets.items():
        good_x, good_out = f32(COLS), f32(ROWS)
        for xname, x in xs.items():
            attempt(f"{tname}.add_to x={xname}", lambda: t.add_to(x, good_out), good_out)
            xb = np.asarray(x)[None] if isinstance(x, np.ndarray) and x.ndim == 1 else x
            ob = f32((1, ROWS))
            attempt(f"{tname}.add_batch_to x={xname}", lambda: t.add_batch_to(xb, ob), ob)
        for oname, out in outs.items():
            attempt(f"{tname}.add_to out={oname}", lambda: t.add_to(good_x, out), out)
            ob = out[None] if isinstance(out, np.ndarray) and out.ndim == 1 else out
            attempt(f"{tname}.add_batch_to out={oname}",
                    lambda: t.add_batch_to(good_x[None], ob), ob)
            orow = out if not isinstance(out, np.ndarray) or out.ndim != 1 else \
                np.zeros(COLS, out.dtype)
            attempt(f"{tname}.add_row_to out={oname}", lambda: t.add_row_to(1, orow), orow)
        # zero-size batches, with good and bad partners
        for xshape, oshape in (((0, COLS), (0, ROWS)), ((0, COLS + 1), (0, ROWS)),
                               ((0, COLS), (0, ROWS + 1)), ((0, 0), (0, 0)),
                               ((1, COLS), (0, ROWS))):
            x, out = np.zeros(xshape, np.float32), np.zeros(oshape, np.float32)
            attempt(f"{tname}.add_batch_to zero-size {xshape}->{oshape}",
                    lambda: t.add_batch_to(x, out), out)
        # overlap, including the same array as x and out
        buf = f32(2 * (COLS + ROWS))
        attempt(f"{tname}.add_to overlap", lambda: t.add_to(buf[:COLS], buf[2:2 + ROWS]), buf)
        sq = f32((N, max(ROWS, COLS)))
        attempt(f"{tname}.add_batch_to same array", lambda: t.add_batch_to(sq[:, :COLS],
                                                                            sq[:, :ROWS]), sq)
        # ids
        out_rows = f32((N, COLS))
        for idname, ids in {
            "huge": [I64_MAX] * N, "i64min": [I64_MIN] * N,
            "u64max": np.full(N, U64_MAX, np.uint64), "py-huge": [2**70] * N,
            "negative": [-1] * N, "bool": [True] * N, "float": [0.0] * N, "nan": [np.nan] * N,
            "0-d": np.array(1), "2-d": np.zeros((N, 1), int), "short": [0] * (N - 1),
            "empty": np.zeros(0, int), "none": None, "str": ["0"] * N, "object": [object()] * N,
            "big-endian": np.zeros(N, ">i8"), "int8-min": np.full(N, -128, np.int8),
            "uint8": np.full(N, 255, np.uint8),
        }.items():
            attempt(f"{tname}.add_rows_to ids={idname}", lambda: t.add_rows_to(ids, out_rows),
                    out_rows)
        row = f32(COLS)
        for r in (I64_MAX, I64_MIN, U64_MAX, 2**70, -1, ROWS, True, 1.0, np.float64(1), None,
                  "1", np.uint64(U64_MAX), np.int8(-1), [1], np.array([1]), np.array(1)):
            attempt(f"{tname}.add_row_to r={r!r}", lambda: t.add_row_to(r, row), row)
        attempt(f"{tname}.add_rows_to zero", lambda: t.add_rows_to([], np.zeros((0, COLS),
                                                                              np.float32)))

    for bname, b in (("bank", bank), ("none-bank", none_bank), ("empty-bank", empty_bank)):
        x, out = f32((N, COLS)), f32((N, ROWS))
        rows_out = f32((N, COLS))
        for aname, aid in {
            "huge": [I64_MAX] * N, "i64min": [I64_MIN] * N,
            "u64max": np.full(N, U64_MAX, np.uint64),
            "py-huge": [2**70] * N, "minus2": [-2] * N, "len": [len(b)] * N, "bool": [True] * N,
            "float": [0.0] * N, "short": [0] * (N - 1), "long": [0] * (N + 1), "0-d": np.array(0),
            "2-d": np.zeros((N, 1), int), "none": None, "ok": [-1, 0, 1, 0][:N],
        }.items():
            attempt(f"{bname}.add_batch_to aid={aname}", lambda: b.add_batch_to(x, out, aid), out)
            attempt(f"{bname}.add_rows_to aid={aname}",
                    lambda: b.add_rows_to([0, 1, 2, 3], rows_out, aid), rows_out)
        for xname, xx in (("int", np.ones((N, COLS), int)), ("0-d", np.array(1.0)),
                          ("none", None), ("1-d", f32(COLS))):
            attempt(f"{bname}.add_batch_to x={xname}", lambda: b.add_batch_to(xx, out, [0] * N),
                    out)
        for oname, oo in (("float64", np.zeros((N, ROWS))), ("0-d", np.zeros((), np.float32)),
                          ("none", None), ("1-d", np.zeros(ROWS, np.float32)),
                          ("list", [[0.0] * ROWS] * N)):
            attempt(f"{bname}.add_batch_to out={oname}", lambda: b.add_batch_to(x, oo, [0] * N))
            attempt(f"{bname}.add_rows_to out={oname}", lambda: b.add_rows_to([0] * N, oo,
                                                                               [0] * N))
        zx, zo = np.zeros((0, COLS), np.float32), np.zeros((0, ROWS), np.float32)
        attempt(f"{bname} zero batch", lambda: b.add_batch_to(zx, zo, np.zeros(0, int)))

    # construction
    big = 2**40
    for name, fn in {
        "from_flat huge rank": lambda: lora.LoraDelta.from_flat(np.zeros(6), np.zeros(5), big,
                                                                3, 4),
        "from_flat negative": lambda: lora.LoraDelta.from_flat(np.zeros(6), np.zeros(5), -2, -3, 4),
        "from_flat i64 overflow": lambda: lora.LoraDelta.from_flat(np.zeros(1), np.zeros(1),
                                                                   2**62, 2**62, 2**62),
        "from_flat float dims": lambda: lora.LoraDelta.from_flat(np.zeros(8), np.zeros(6), 2.5,
                                                                 3, 4),
        "from_flat none": lambda: lora.LoraDelta.from_flat(None, None, 1, 1, 1),
        "rank 0": lambda: lora.LoraDelta(np.zeros((0, 4)), np.zeros((3, 0))),
        "0-d weights": lambda: lora.LoraDelta(np.float32(1), np.float32(1)),
        "1-d weights": lambda: lora.LoraDelta(np.zeros(4), np.zeros(3)),
        "3-d weights": lambda: lora.LoraDelta(np.zeros((1, 2, 3)), np.zeros((3, 1))),
        "int weights": lambda: lora.LoraDelta(np.zeros((2, 4), int), np.zeros((3, 2), int)),
        "object weights": lambda: lora.LoraDelta(np.array([[object()]]), np.zeros((1, 1))),
        "nan weights": lambda: lora.LoraDelta(np.full((2, 4), np.nan), np.zeros((3, 2))),
        "f16 overflow": lambda: lora.LoraDelta(np.full((2, 4), 7e4), np.zeros((3, 2)),
                                               dtype="float16"),
        "bad dtype": lambda: lora.LoraDelta(np.zeros((2, 4)), np.zeros((3, 2)), dtype="int4"),
        "nan alpha": lambda: lora.LoraDelta(np.zeros((2, 4)), np.zeros((3, 2)), alpha=float("nan")),
        "str alpha": lambda: lora.LoraDelta(np.zeros((2, 4)), np.zeros((3, 2)), alpha="1"),
        "bad base_shape": lambda: lora.LoraDelta(np.zeros((2, 4)), np.zeros((3, 2)),
                                                 base_shape=(3,)),
        "huge base_shape": lambda: lora.LoraDelta(np.zeros((2, 4)), np.zeros((3, 2)),
                                                  base_shape=(2**70, 4)),
        "scale inf": lambda: lora.LoraScale(float("inf")),
        "scale str": lambda: lora.LoraScale("1"),
        "threads 0": lambda: lora.set_num_threads(0),
        "threads huge": lambda: lora.set_num_threads(2**70),
        "threads -huge": lambda: lora.set_num_threads(-2**70),
        "stack mismatch": lambda: lora.LoraStack([deltas["f32"], lora.LoraDelta(np.zeros((1, 3)),
                                                                                np.zeros((2, 1)))]),
        "bank mismatch": lambda: lora.LoraBank([deltas["f32"], lora.LoraDelta(np.zeros((1, 3)),
                                                                              np.zeros((2, 1)))]),
        "bank junk": lambda: lora.LoraBank([1, 2]),
        "merge junk": lambda: deltas["f32"].merge_into(np.zeros((ROWS, COLS), np.float16)),
        "merge 0-d": lambda: deltas["f32"].merge_into(np.zeros((), np.float32)),
    }.items():
        attempt(name, fn)
    lora.set_num_threads(2**20)

    print(f"DONE {cases}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
