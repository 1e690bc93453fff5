"""Golden bits: the exact output of every kernel path, pinned.

The other guarantee tests pin *invariance* (the same bits across threads, batches, banks); this
file pins the bits themselves, per ISA path x storage dtype x activation dtype x output dtype x
operation, so a refactor of the kernels or of apply.c's runners that changes any summation order is
caught even when it is consistent everywhere.  The expected SHA-256 of each case lives in
``tests/golden_bits.json``, recorded from the kernels as they were when this file was written.

Inputs come from an integer hash (no random generator whose stream could change between NumPy
versions), scaled so that nothing overflows a half-precision output.

To record a new path (a new ISA) or, after a deliberate and documented change of a summation
order, the whole file: ``LORA_GOLDEN_RECORD=1 pytest tests/test_golden_bits.py`` (it then
writes the cases of every ISA path this machine runs and keeps the other paths' records).
"""

import hashlib
import json
import os

import numpy as np
import pytest

import lora
from lora import _runtime
from conftest import using_isa, num_threads

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_bits.json")
RECORD = os.environ.get("LORA_GOLDEN_RECORD") == "1"
DTYPES = ("float32", "float16", "bfloat16")
ROWS, COLS = 45, 70      # tails of 8, 16 and 32 lanes on both axes
RANKS = (1, 7, 17, 40)   # one lane; a partial tile; past one rank block; several blocks
BATCHES = (1, 3, 6, 300)  # decode; partial blocks; 300 >= the runner's widen-to-float32 size


def values(shape, seed, scale=1.0):
    """Deterministic float64 values in [-scale/2, scale/2) from an integer hash."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64) + np.uint64(seed * 1000003)
    h = (i * np.uint64(0x9E3779B97F4A7C15)) ^ (i >> np.uint64(7))
    h = (h * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(0xFFFFFFFF)
    return ((h.astype(np.float64) / 2.0**32) - 0.5).reshape(shape) * scale


def as_dtype(v, name):
    if name == "bfloat16":
        import ml_dtypes

        return v.astype(np.float32).astype(ml_dtypes.bfloat16)
    return v.astype(name)


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()[:24]


def delta(rank, storage, seed, *, rows=ROWS, cols=COLS, alpha=0.0):
    a = values((rank, cols), seed, 2.0)
    b = values((rows, rank), seed + 1, 2.0)
    return lora.LoraDelta(a, b, alpha=alpha, scale=0.75, dtype=storage)


def batch_cases(got, d, name, xts, seed):
    """got[batch/<name>/x<xt>/o<ot>/b<batch>]: decode and batches of every x dtype in xts and
    out dtype, inputs from seed (x) and seed + 2 (out)."""
    for xt in xts:
        for ot in DTYPES:
            for batch in BATCHES:
                x = as_dtype(values((batch, COLS), seed + batch), xt)
                out = as_dtype(values((batch, ROWS), seed + 2 + batch, 8.0), ot)
                if batch == 1:
                    d.add_to(x[0], out[0])
                else:
                    d.add_batch_to(x, out)
                got[f"batch/{name}/x{xt}/o{ot}/b{batch}"] = digest(out)


def stack_bank_cases(got, stack, bank, tag, seed):
    """got[stack<tag>/o<ot>/b<batch>] and got[bank<tag>/...]: a stack's batches, and a bank's
    with ids over its entries (-1 included) and per-position scales, every out dtype; inputs
    from seed (x), seed + 2 (the stack's out), seed + 6 (the bank's out), seed + 8 (scales)."""
    for ot in DTYPES:
        for batch in (1, 5, 300):
            x = as_dtype(values((batch, COLS), seed + batch), "float32")
            out = as_dtype(values((batch, ROWS), seed + 2 + batch, 8.0), ot)
            stack.add_batch_to(x, out)
            got[f"stack{tag}/o{ot}/b{batch}"] = digest(out)
            ids = (np.arange(batch) * 5 + 1) % 5 - 1
            scales = 0.25 + values((batch,), seed + 8)
            out = as_dtype(values((batch, ROWS), seed + 6 + batch, 8.0), ot)
            bank.add_batch_to(x, out, ids, scales=scales)
            got[f"bank{tag}/o{ot}/b{batch}"] = digest(out)


def cases():
    """{case name: hex digest} for the ISA path in use."""
    got = {}
    for st in DTYPES:
        for rank in RANKS:
            d = delta(rank, st, rank, alpha=2.0 * rank)
            batch_cases(got, d, f"{st}/r{rank}", DTYPES, 11)
            for xt in DTYPES:
                # the gather (rows of B @ A)
                ids = (np.arange(37) * 7) % ROWS
                out = as_dtype(values((37, COLS), 17, 8.0), xt)
                d.add_rows_to(ids, out)
                got[f"rows/{st}/r{rank}/o{xt}"] = digest(out)
    # stacks of members of every storage dtype, and banks with per-position scales
    members = [delta(r, st, 40 + r) for r, st in ((5, "float32"), (17, "bfloat16"), (9, "float16"))]
    stack = lora.LoraStack(members)
    bank = lora.LoraBank([members[0], stack, None, members[2]])
    stack_bank_cases(got, stack, bank, "", 21)
    for ot in DTYPES:
        tok = (np.arange(33) * 3) % ROWS
        out = as_dtype(values((33, COLS), 31, 8.0), ot)
        bank.add_rows_to(tok, out, (np.arange(33) % 5) - 1)
        got[f"bank_rows/o{ot}"] = digest(out)
    # views over a caller's memory held by output (PEFT's lora_B [out, r]; an embedding's A^T)
    for st in DTYPES:
        for rank in (3, 17, 40):
            a = as_dtype(values((rank, COLS), 50 + rank, 2.0), st)
            b = as_dtype(values((ROWS, rank), 51 + rank, 2.0), st)
            keep = (a, b)
            v = lora.LoraDelta.view((a.ctypes.data, COLS), (b.ctypes.data, rank), dtype=st,
                                    rank=rank, rows=ROWS, cols=COLS, b_by_row=True, scale=0.5,
                                    keep=keep)
            for ot in DTYPES:
                x = as_dtype(values((6, COLS), 53), "float32")
                out = as_dtype(values((6, ROWS), 55, 8.0), ot)
                v.add_batch_to(x, out)
                got[f"view_b_by_row/{st}/r{rank}/o{ot}"] = digest(out)
            at = np.ascontiguousarray(a.T)  # A^T [cols, rank]: the gather by row
            bt = np.ascontiguousarray(b.T)  # B^T [rank, rows]
            g = lora.LoraDelta.view((at.ctypes.data, rank), (bt.ctypes.data, ROWS), dtype=st,
                                    rank=rank, rows=ROWS, cols=COLS, a_by_row=True, scale=0.5,
                                    keep=(at, bt))
            out = values((9, COLS), 57, 8.0).astype(np.float32)
            g.add_rows_to(np.arange(9) * 4, out)
            got[f"view_a_by_row/{st}/r{rank}"] = digest(out)
    # q8_0 storage (blocks of 32 int8 values and a float16 scale), alone and paired with
    # another format, in every op; stacks and banks holding q8_0 members
    for st in ("q8_0", "q8_0/float16", "bfloat16/q8_0"):
        for rank in RANKS:
            d = delta(rank, st, 70 + rank, alpha=2.0 * rank)
            batch_cases(got, d, f"{st}/r{rank}", DTYPES if st == "q8_0" else ("float32",), 71)
            ids = (np.arange(37) * 7) % ROWS
            out = as_dtype(values((37, COLS), 77, 8.0), "float32")
            d.add_rows_to(ids, out)
            got[f"rows/{st}/r{rank}"] = digest(out)
    q_members = [delta(r, st, 80 + r) for r, st in ((5, "q8_0"), (17, "bfloat16"), (33, "q8_0"))]
    q_stack = lora.LoraStack(q_members)
    q_bank = lora.LoraBank([q_members[0], q_stack, None, q_members[1]])
    stack_bank_cases(got, q_stack, q_bank, "_q8_0", 81)
    # merges into every weight dtype, both layouts
    for st in DTYPES + ("q8_0",):
        d = delta(17, st, 60, alpha=8.0)
        for wt in DTYPES:
            w = as_dtype(values((ROWS, COLS), 61, 4.0), wt)
            d.merge_into(w)
            wt_view = as_dtype(values((COLS, ROWS), 62, 4.0), wt)
            d.merge_into(wt_view.T)
            got[f"merge/{st}/w{wt}"] = digest(w, wt_view)
    return got


def _load():
    if os.path.exists(GOLDEN):
        with open(GOLDEN) as fh:
            return json.load(fh)
    return {}


@pytest.mark.parametrize("isa_name", _runtime.available_isas())
def test_golden_bits(isa_name):
    """Every case's bits equal the recorded ones for this ISA path (one and two threads)."""
    with using_isa(isa_name):
        with num_threads(1):
            got = cases()
        with num_threads(2):
            assert cases() == got, "bits differ between one and two threads"
    golden = _load()
    if RECORD:
        golden[isa_name] = got
        with open(GOLDEN, "w") as fh:
            json.dump(golden, fh, indent=1, sort_keys=True)
            fh.write("\n")
        return
    want = golden.get(isa_name)
    assert want is not None, (f"no golden bits recorded for the {isa_name} path: record them "
                              f"with LORA_GOLDEN_RECORD=1 (see this file's docstring)")
    missing = sorted(set(want) - set(got))
    changed = sorted(k for k in want if k in got and got[k] != want[k])
    extra = sorted(set(got) - set(want))
    assert not missing and not changed and not extra, (
        f"{isa_name}: {len(changed)} cases changed bits (first: {changed[:5]}), "
        f"{len(missing)} missing, {len(extra)} not recorded (first: {extra[:3]})")
