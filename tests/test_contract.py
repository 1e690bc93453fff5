"""The input contract (docs/input-contract.md): every bad input gets the documented exception type, a message that
names the expected and the actual value, and leaves `out` (and `w`) exactly as it was — also when
the effective scale is 0 ("Validation always runs")."""

import math
import os
import subprocess
import warnings

import numpy as np
import pytest

import lora
from conftest import ISAS, PYTHON, assert_same_bits, rand, subprocess_env

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

RANK, ROWS, COLS, N = 3, 6, 8, 4


def rejects(exc, fragments, call, *watched):
    """`call()` raises `exc` whose message holds every fragment; every watched array keeps its
    bytes (and its writeable flag)."""
    snaps = [(w.tobytes(), w.flags.writeable) for w in watched]
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in the message {msg!r}"
    for w, (b, wr) in zip(watched, snaps):
        assert w.tobytes() == b, f"a failed call changed an array: {msg}"
        assert w.flags.writeable == wr
    return info.value


@pytest.fixture(params=[1.0, 0.0], ids=["scale1", "scale0"])
def scale(request):
    return request.param


def _delta(rng, scale, rank=RANK, rows=ROWS, cols=COLS, dtype="float32"):
    return lora.LoraDelta(rng.standard_normal((rank, cols)), rng.standard_normal((rows, rank)),
                          alpha=4.0, scale=scale, dtype=dtype)


@pytest.fixture(params=["delta", "stack", "bank"])
def target(request, scale):
    """(kind, object with the add_* methods taking the bank's adapter ids when a bank)."""
    rng = np.random.default_rng(0)
    s = lora.LoraScale(scale)
    d1, d2 = _delta(rng, s), _delta(rng, s, rank=5, dtype="bfloat16")
    if request.param == "delta":
        return request.param, d1
    if request.param == "stack":
        return request.param, lora.LoraStack([d1, d2])
    return request.param, lora.LoraBank([d1, None, lora.LoraStack([d1, d2])])


AIDS = np.array([0, -1, 2, 0])


def ops(kind, obj):
    """name -> (call(x_or_ids, out), good x/ids, good out); the bank has only the batched two."""
    if kind == "bank":
        return {
            "add_batch_to": (lambda x, o: obj.add_batch_to(x, o, AIDS),
                             rand(np.random.default_rng(1), (N, COLS)), (N, ROWS)),
            "add_rows_to": (lambda i, o: obj.add_rows_to(i, o, AIDS), np.array([0, 5, 2, 2]),
                            (N, COLS)),
        }
    rng = np.random.default_rng(1)
    return {
        "add_to": (obj.add_to, rand(rng, COLS), (ROWS,)),
        "add_batch_to": (obj.add_batch_to, rand(rng, (N, COLS)), (N, ROWS)),
        "add_row_to": (obj.add_row_to, 5, (COLS,)),
        "add_rows_to": (obj.add_rows_to, np.array([0, 5, 2, 2]), (N, COLS)),
    }


# ------------------------------------------------------------------- out


def test_out_wrong_dtype(target):
    kind, obj = target
    for name, (call, arg, shape) in ops(kind, obj).items():
        for bad in (np.float64, np.int32, ">f4", ">f2"):  # float16/bfloat16 are outputs too
            out = np.zeros(shape, bad)
            rejects(TypeError, ["float32", "float16", "bfloat16", str(out.dtype)],
                    lambda: call(arg, out), out)


def test_out_wrong_shape(target):
    kind, obj = target
    for name, (call, arg, shape) in ops(kind, obj).items():
        bad_shapes = [shape[:-1] + (shape[-1] + 1,), shape[:-1] + (shape[-1] - 1,)]
        if len(shape) == 2:
            bad_shapes += [(shape[0] + 1, shape[1]), (shape[-1],)]
        else:
            bad_shapes += [(1,) + shape]
        for bs in bad_shapes:
            out = rand(np.random.default_rng(2), bs)
            if name == "add_rows_to" and len(bs) == 2 and bs[1] == shape[1]:
                # out [n, cols] sets n: a different n is a length mismatch with the ids
                rejects(ValueError, [str(bs[0]), str(shape[0])], lambda: call(arg, out), out)
                continue
            exc = rejects(ValueError, [str(bs)], lambda: call(arg, out), out)
            # the message names what was wanted: the full shape, or at least its last dimension
            msg = str(exc)
            assert str(shape) in msg or str(shape[-1]) in msg, (name, bs, msg)


def test_out_read_only(target):
    kind, obj = target
    for name, (call, arg, shape) in ops(kind, obj).items():
        out = rand(np.random.default_rng(3), shape)
        out.flags.writeable = False
        rejects(ValueError, ["read-only"], lambda: call(arg, out), out)
        # a read-only view of a writeable array: also refused, the base untouched
        base = rand(np.random.default_rng(3), shape)
        view = base[...]
        view.flags.writeable = False
        rejects(ValueError, ["read-only"], lambda: call(arg, view), base)


def test_out_not_contiguous(target):
    kind, obj = target
    for name, (call, arg, shape) in ops(kind, obj).items():
        if len(shape) == 1:
            big = rand(np.random.default_rng(4), 2 * shape[0])
            out = big[::2]
            rejects(ValueError, ["contiguous", str(out.strides)], lambda: call(arg, out), big)
            big = rand(np.random.default_rng(4), shape[0])
            out = big[::-1]
            rejects(ValueError, ["contiguous"], lambda: call(arg, out), big)
        else:
            big = rand(np.random.default_rng(4), (shape[0], 2 * shape[1]))
            out = big[:, ::2]  # last stride 8 bytes: not row-strided, refused (never copied)
            rejects(ValueError, [str(out.strides)], lambda: call(arg, out), big)
            out = np.asfortranarray(rand(np.random.default_rng(4), shape))
            rejects(ValueError, [str(out.strides)], lambda: call(arg, out), out)
            big = rand(np.random.default_rng(4), shape)
            out = big[::-1]  # negative row stride
            rejects(ValueError, [str(out.strides)], lambda: call(arg, out), big)


def test_out_not_an_ndarray(target):
    kind, obj = target
    for name, (call, arg, shape) in ops(kind, obj).items():
        out = np.zeros(shape, np.float32).tolist()
        rejects(TypeError, ["list"], lambda: call(arg, out))
        rejects(TypeError, ["tuple"], lambda: call(arg, tuple(out)))


# --------------------------------------------------------------------- x


def x_ops(kind, obj):
    return {k: v for k, v in ops(kind, obj).items() if k in ("add_to", "add_batch_to")}


def test_x_wrong_kind(target):
    kind, obj = target
    for name, (call, x, shape) in x_ops(kind, obj).items():
        out = rand(np.random.default_rng(5), shape)
        for bad in (x.astype(np.int64), x.astype(np.int8), x.astype(np.complex64),
                    x.astype(object), x > 0, x.astype(np.uint32)):
            rejects(TypeError, [str(bad.dtype)], lambda: call(bad, out), out)
        rejects(TypeError, ["x"], lambda: call(np.full(x.shape, "a"), out), out)
        rejects(TypeError, ["int64"], lambda: call(np.ones(x.shape, int).tolist(), out), out)


def test_x_wrong_shape(target):
    kind, obj = target
    for name, (call, x, shape) in x_ops(kind, obj).items():
        out = rand(np.random.default_rng(6), shape)
        bads = [np.zeros(x.shape[:-1] + (COLS + 1,), np.float32),
                np.zeros(x.shape[:-1] + (COLS - 1,), np.float64),
                np.zeros(x.shape + (1,), np.float32), np.float32(1.0) + np.zeros((), np.float32)]
        if x.ndim == 2:
            bads += [np.zeros((N + 1, COLS), np.float32), np.zeros(COLS, np.float32)]
        for bad in bads:
            rejects(ValueError, [str(bad.shape), str(COLS)], lambda: call(bad, out), out)


def test_x_out_overlap(target):
    """x and out views of one buffer (address ranges intersect): ValueError, nothing written;
    also when x needs a conversion first (a float64 view of the same bytes)."""
    kind, obj = target
    for name, (call, x, shape) in x_ops(kind, obj).items():
        n = int(np.prod(shape))
        buf = rand(np.random.default_rng(7), 4 * (n + x.size))
        out = buf[2:2 + n].reshape(shape)
        xs = buf[:x.size].reshape(x.shape)                     # starts before, runs into out
        rejects(ValueError, ["overlap"], lambda: call(xs, out), buf)
        xs = buf[n:n + x.size].reshape(x.shape)                # starts inside out
        rejects(ValueError, ["overlap"], lambda: call(xs, out), buf)
        x64 = buf.view(np.float64)[: x.size].reshape(x.shape)  # a float64 view over out's bytes
        rejects(ValueError, ["overlap"], lambda: call(x64, out), buf)
    # interleaved rows of one fused buffer: the address ranges intersect, which is what "overlapping" means
    if "add_batch_to" in x_ops(kind, obj):
        call, x, shape = x_ops(kind, obj)["add_batch_to"]
        fused = rand(np.random.default_rng(8), (N, COLS + ROWS))
        rejects(ValueError, ["overlap"], lambda: call(fused[:, :COLS], fused[:, COLS:]), fused)


def test_x_accepted_conversions_do_not_alias(target):
    """Disjoint buffers are fine, also in one allocation, in any float dtype."""
    kind, obj = target
    for name, (call, x, shape) in x_ops(kind, obj).items():
        n = int(np.prod(shape))
        buf = np.zeros(n + x.size, np.float32)
        out = buf[:n].reshape(shape)
        xs = buf[n:].reshape(x.shape)
        xs[...] = x
        assert call(xs, out) is out
        for dt in (np.float64, np.float16) + ((BF16,) if BF16 is not None else ()):
            assert call(x.astype(dt), np.zeros(shape, np.float32)) is not None


# ------------------------------------------------------------------- ids


def id_ops(kind, obj):
    return {k: v for k, v in ops(kind, obj).items() if k in ("add_row_to", "add_rows_to")}


def test_token_id_out_of_range(target):
    """No wrap-around: ids >= rows and negative ids are IndexError naming the id and, for a batch,
    its position; checked before anything is written."""
    kind, obj = target
    for name, (call, ids, shape) in id_ops(kind, obj).items():
        out = rand(np.random.default_rng(9), shape)
        if name == "add_row_to":
            for bad in (ROWS, ROWS + 100, -1, -ROWS, 2**62, np.int64(-2**63), np.uint64(2**64 - 1)):
                rejects(IndexError, [str(int(bad))], lambda: call(bad, out), out)
            continue
        for pos, bad in ((2, ROWS), (1, -1), (3, -ROWS), (0, 2**62), (3, -2**63)):
            bad_ids = np.array(ids, np.int64)
            bad_ids[pos] = bad
            rejects(IndexError, [str(bad), f"position {pos}"], lambda: call(bad_ids, out), out)
        big = np.array(ids, np.uint64)
        big[2] = 2**64 - 1
        got = rejects(IndexError, [str(2**64 - 1), "position 2", f"[0, {ROWS})"],
                      lambda: call(big, out), out)
        # past int64 (uint64), the same wording as an int64 id out of range, valid range included
        bad_ids = np.array(ids, np.int64)
        bad_ids[2] = 2**62
        want = rejects(IndexError, [], lambda: call(bad_ids, out), out)
        assert str(got).replace(str(2**64 - 1), "ID") == str(want).replace(str(2**62), "ID")


def test_token_id_wrong_kind(target):
    kind, obj = target
    for name, (call, ids, shape) in id_ops(kind, obj).items():
        out = rand(np.random.default_rng(10), shape)
        if name == "add_row_to":
            for bad in (True, np.bool_(False), 1.0, np.float32(2.0), "1", None, [1]):
                rejects(TypeError, [], lambda: call(bad, out), out)
            continue
        for bad in (np.array(ids) > 2, np.array(ids, np.float64), np.array(ids, np.float32),
                    [0.0, 1.0, 2.0, 3.0], np.array(ids, np.complex64), np.array(ids, object)):
            rejects(TypeError, [str(np.asarray(bad).dtype)], lambda: call(bad, out), out)


def test_token_ids_wrong_shape(target):
    kind, obj = target
    call, ids, shape = id_ops(kind, obj)["add_rows_to"]
    out = rand(np.random.default_rng(11), shape)
    for bad in (ids[:3], np.concatenate([ids, ids]), ids.reshape(2, 2), np.array(1)):
        rejects(ValueError, [], lambda: call(bad, out), out)


# ---------------------------------------------------------------- banks


@pytest.fixture
def bank(scale):
    rng = np.random.default_rng(12)
    s = lora.LoraScale(scale)
    return lora.LoraBank([_delta(rng, s), None, _delta(rng, s, rank=2)])


def test_adapter_ids_wrong_length(bank):
    x, out = rand(np.random.default_rng(13), (N, COLS)), rand(np.random.default_rng(14), (N, ROWS))
    rows_out = rand(np.random.default_rng(15), (N, COLS))
    for bad in ([0, 1, 2], [0, 1, 2, 0, 1], np.array([], int), np.zeros((2, 2), int)):
        rejects(ValueError, [], lambda: bank.add_batch_to(x, out, bad), out)
        rejects(ValueError, [], lambda: bank.add_rows_to([0, 1, 2, 3], rows_out, bad), rows_out)
    exc = rejects(ValueError, ["3", "4"], lambda: bank.add_batch_to(x, out, [0, 1, 2]), out)
    assert "adapter_ids" in str(exc)


def test_adapter_ids_out_of_range(bank):
    """Only -1 means "no adapter": -2, len(entries) and huge ids are IndexError naming the id and
    its position, with nothing written (no wrap-around to the last slot)."""
    x, out = rand(np.random.default_rng(16), (N, COLS)), rand(np.random.default_rng(17), (N, ROWS))
    rows_out = rand(np.random.default_rng(18), (N, COLS))
    for pos, bad in ((3, 3), (1, -2), (2, 2**40), (0, -2**63)):
        ids = np.array([0, 2, -1, 1], np.int64)
        ids[pos] = bad
        rejects(IndexError, [str(bad), f"position {pos}"], lambda: bank.add_batch_to(x, out, ids),
                out)
        rejects(IndexError, [str(bad), f"position {pos}"],
                lambda: bank.add_rows_to([0, 1, 2, 3], rows_out, ids), rows_out)
    big = np.array([0, 2**64 - 1, 0, 0], np.uint64)
    got = rejects(IndexError, [str(2**64 - 1), "position 1",
                               "valid ids are -1 (no adapter) and 0..2"],
                  lambda: bank.add_batch_to(x, out, big), out)
    want = rejects(IndexError, [], lambda: bank.add_batch_to(x, out, [0, 2**40, 0, 0]), out)
    assert str(got).replace(str(2**64 - 1), "ID") == str(want).replace(str(2**40), "ID")


def test_adapter_ids_wrong_kind(bank):
    x, out = rand(np.random.default_rng(19), (N, COLS)), rand(np.random.default_rng(20), (N, ROWS))
    for bad in (np.array([True, False, True, True]), np.array([0.0, 1.0, 2.0, 0.0]),
                [0.0, 1.0, 2.0, 0.0]):
        rejects(TypeError, [str(np.asarray(bad).dtype)], lambda: bank.add_batch_to(x, out, bad),
                out)


def test_bank_token_id_error_beats_writes(bank):
    """A bad token id late in the batch: nothing written for the earlier, valid positions."""
    out = rand(np.random.default_rng(21), (N, COLS))
    rejects(IndexError, [str(ROWS), "position 3"],
            lambda: bank.add_rows_to([0, 1, 2, ROWS], out, [0, 2, 0, 2]), out)
    rejects(IndexError, ["-1", "position 2"],
            lambda: bank.add_rows_to([0, 1, -1, 2], out, [0, 2, 0, 2]), out)


# -------------------------------------------------- empty containers validate too


def test_empty_stack_still_validates():
    empty = lora.LoraStack()
    out = rand(np.random.default_rng(22), ROWS)
    rejects(TypeError, ["int64"], lambda: empty.add_to(np.zeros(COLS, np.int64), out), out)
    rejects(TypeError, ["float64"], lambda: empty.add_to(np.zeros(COLS), out.astype(np.float64)))
    ro = out.copy()
    ro.flags.writeable = False
    rejects(ValueError, ["read-only"], lambda: empty.add_to(np.zeros(COLS), ro), ro)
    rejects(TypeError, ["bool"], lambda: empty.add_rows_to(np.array([True]), out[None, :]), out)


def test_empty_stack_add_row_to_validates_the_id():
    """Token ids are checked also by an empty stack: a bool/float id is a TypeError and a negative
    id (out of range for every base) an IndexError, as for a non-empty stack."""
    empty = lora.LoraStack()
    out = rand(np.random.default_rng(23), COLS)
    rejects(TypeError, [], lambda: empty.add_row_to(True, out), out)
    rejects(TypeError, [], lambda: empty.add_row_to(1.5, out), out)
    rejects(IndexError, ["-1"], lambda: empty.add_row_to(-1, out), out)


def test_bank_without_deltas_still_validates_x():
    """A bank whose every slot is None has no shape, but x must still be a real float array
    (validation runs even when nothing would be written) and must not overlap out."""
    bank = lora.LoraBank([None, None])
    out = rand(np.random.default_rng(24), (2, ROWS))
    rejects(TypeError, ["int64"], lambda: bank.add_batch_to(np.zeros((2, COLS), np.int64), out,
                                                            [0, 1]), out)
    rejects(TypeError, ["complex"], lambda: bank.add_batch_to(np.zeros((2, COLS), complex), out,
                                                              [0, -1]), out)
    rejects(ValueError, ["overlap"], lambda: bank.add_batch_to(out, out, [0, 1]), out)


def test_bank_without_deltas_checks_ids():
    bank = lora.LoraBank([None, None])
    x, out = np.zeros((2, COLS), np.float32), rand(np.random.default_rng(25), (2, ROWS))
    rejects(IndexError, ["2", "position 1"], lambda: bank.add_batch_to(x, out, [0, 2]), out)
    rejects(ValueError, [], lambda: bank.add_batch_to(x, out, [0]), out)
    rejects(TypeError, ["float64"], lambda: bank.add_batch_to(x, out.astype(np.float64), [0, 1]))
    assert bank.add_batch_to(x, out, [-1, 1]) is out


# ---------------------------------------------------------- construction


def test_shape_error_exact_message():
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta.from_flat(np.zeros(6), np.zeros(5), 2, 3, 4)
    e = info.value
    assert str(e) == ("LoRA pair does not fit a [3 x 4] base at rank 2: lora_a has 6 values "
                      "(want rank x cols = 8), lora_b has 5 values (want rows x rank = 6)")
    assert (e.rows, e.cols, e.rank, e.a_len, e.b_len) == (3, 4, 2, 6, 5)
    assert isinstance(e, ValueError)


def test_shape_error_names_both_shapes_and_the_base():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 53)), rng.standard_normal((37, 4))
    # a 37 x 53 pair against a 37 x 54 base: the pair's 53 and the base's 54 are both named
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta(a, b, base_shape=(37, 54))
    msg = str(info.value)
    assert msg.startswith("LoRA pair does not fit a [37 x 54] base at rank 4: ")
    assert "[37 x 53] at rank 4" in msg and "(37, 54)" in msg
    # B passed for A (and A for B): both shapes shown, and the likely mistake named
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta(b, a)
    msg = str(info.value)
    assert "(37, 4)" in msg and "(4, 53)" in msg and "swapped?" in msg
    # a 3-D lora_a: its shape is shown
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta(a.reshape(4, 53, 1), b)
    assert "(4, 53, 1)" in str(info.value) and "2-D" in str(info.value)


@pytest.mark.parametrize("a_shape, b_shape, hint", [
    ((48,), (8, 4), "LoraDelta.from_flat"),                   # a flat lora_a
    ((4, 48), (32,), "LoraDelta.from_flat"),                  # a flat lora_b
    ((2, 4, 48), (8, 4), "lora.LoraExperts"),                  # a 3-D lora_a: experts
    ((2, 4, 48), (2, 8, 4), "lora.LoraExperts"),               # a 3-D pair
])
def test_factors_that_are_not_2d_say_so_first(a_shape, b_shape, hint):
    """The message opens with the rule broken (both factors 2-D), names each wrong factor's
    shape, and points at the constructor that takes such factors; no base at rank 0 is
    invented from them."""
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta(np.ones(a_shape, np.float32), np.ones(b_shape, np.float32))
    msg = str(info.value)
    assert msg.startswith("lora_a and lora_b must be 2-D, lora_a [rank, cols] and lora_b "
                          "[rows, rank]; "), msg
    for name, shape in (("lora_a", a_shape), ("lora_b", b_shape)):
        assert (f"{name} has shape {shape}" in msg) == (len(shape) != 2), msg
    assert hint in msg and "rank 0" not in msg
    assert (info.value.a_len, info.value.b_len) == (int(np.prod(a_shape)), int(np.prod(b_shape)))


def test_shape_error_two_d_constructor():
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta(np.zeros((2, 4)), np.zeros((3, 3)))
    e = info.value
    assert (e.rows, e.cols, e.rank, e.a_len, e.b_len) == (3, 4, 2, 8, 9)
    # the fixed wording stays the message's prefix; the shapes given follow it
    assert str(e).startswith("LoRA pair does not fit a [3 x 4] base at rank 2: lora_a has 8 "
                             "values (want rank x cols = 8), lora_b has 9 values (want rows x "
                             "rank = 6)")
    assert "(2, 4)" in str(e) and "(3, 3)" in str(e)
    # base_shape is checked when given
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta(np.zeros((2, 4)), np.zeros((3, 2)), base_shape=(3, 5))
    assert "[3 x 5]" in str(info.value)
    assert lora.LoraDelta(np.zeros((2, 4)), np.zeros((3, 2)), base_shape=(3, 4)).rows == 3
    for a, b in ((np.zeros(8), np.zeros((3, 2))), (np.zeros((2, 4, 1)), np.zeros((3, 2)))):
        with pytest.raises(lora.LoraShapeError):
            lora.LoraDelta(a, b)


def test_rank_zero_refused():
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta(np.zeros((0, 4)), np.zeros((3, 0)))
    assert info.value.rank == 0 and "rank 0" in str(info.value)
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraDelta.from_flat(np.zeros(0), np.zeros(0), 0, 3, 4)
    assert info.value.rank == 0 and "rank 0" in str(info.value)
    for rank, rows, cols in ((-1, 3, 4), (1, 0, 4), (1, 3, 0)):
        with pytest.raises(lora.LoraShapeError):
            lora.LoraDelta.from_flat(np.zeros(0), np.zeros(0), rank, rows, cols)
    # a negative rank is named as such, not as "a [-4 x 8] base at rank -2"
    with pytest.raises(lora.LoraShapeError, match=r"^rank and rows must be positive: got rank -2, "
                                                  r"rows -4, cols 8") as info:
        lora.LoraDelta.from_flat(np.ones(16), np.ones(8), -2, -4, 8)
    assert "base" not in str(info.value) and info.value.rank == -2


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_non_finite_weights_refused(dtype):
    for bad in (np.nan, np.inf, -np.inf):
        a = np.ones((2, 4))
        a[1, 2] = bad
        with pytest.raises(ValueError, match="lora_a"):
            lora.LoraDelta(a, np.ones((3, 2)), dtype=dtype)
        b = np.ones((3, 2), np.float32)
        b[2, 0] = bad
        with pytest.raises(ValueError, match="lora_b"):
            lora.LoraDelta(np.ones((2, 4)), b, dtype=dtype)
        with pytest.raises(ValueError, match="lora_b"):
            lora.LoraDelta.from_flat(np.ones(8), b.ravel(), 2, 3, 4, dtype=dtype)
    with pytest.raises(ValueError):
        lora.LoraDelta(np.ones((2, 4), np.float16) * np.float16(np.inf), np.ones((3, 2)))


def test_weights_must_be_float():
    for a in (np.ones((2, 4), int), np.ones((2, 4), complex), [[1, 2, 3, 4], [1, 2, 3, 4]]):
        with pytest.raises(TypeError):
            lora.LoraDelta(a, np.ones((3, 2)))


def test_non_finite_alpha_and_scale_refused():
    a, b = np.ones((2, 4)), np.ones((3, 2))
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="alpha"):
            lora.LoraDelta(a, b, alpha=bad)
        with pytest.raises(ValueError):
            lora.LoraDelta(a, b, scale=bad)
        with pytest.raises(ValueError):
            lora.LoraScale(bad)
        s = lora.LoraScale(0.5)
        with pytest.raises(ValueError):
            s.set(bad)
        with pytest.raises(ValueError):
            s.value = bad
        assert s.value == 0.5 and s.get() == 0.5


@pytest.mark.parametrize("bad", [True, np.bool_(False), np.array(True)],
                         ids=["bool", "np.bool_", "0d-bool-array"])
def test_a_bool_is_not_a_scale_in_any_spelling(bad):
    """Python's bool, NumPy's np.bool_ and a 0-d bool array all have __float__; none is a
    scale (a bool where a number belongs is a mistake, as for ids)."""
    with pytest.raises(TypeError, match="real number"):
        lora.LoraScale(bad)
    s = lora.LoraScale(0.5)
    with pytest.raises(TypeError, match="real number"):
        s.set(bad)
    assert s.value == 0.5
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="real number"):
        lora.LoraScale(torch.tensor(True))
    assert lora.LoraScale(np.float32(2)).value == 2.0 and lora.LoraScale(np.array(3.0)).value == 3.0


@pytest.mark.parametrize("bad", [1e39, -1e39, 3.5e38, 2.0 ** 128, 10 ** 39])
def test_scale_past_float32_range_refused_where_it_is_set(bad):
    """Finite as a Python float but inf in float32, the precision every call computes in: refused
    when the scale is set, not at every later call."""
    with pytest.raises(ValueError, match="finite in float32"):
        lora.LoraScale(bad)
    s = lora.LoraScale(0.5)
    for setter in (s.set, lambda v: setattr(s, "value", v)):
        with pytest.raises(ValueError, match="finite in float32"):
            setter(bad)
    assert s.value == 0.5
    with pytest.raises(ValueError, match="finite in float32"):
        lora.LoraDelta(np.ones((2, 4)), np.ones((3, 2)), scale=bad)
    f32_max = float(np.finfo(np.float32).max)
    assert lora.LoraScale(-f32_max).value == -f32_max       # the largest float32 is fine


def test_storage_overflow_refused():
    a, b = np.ones((2, 4)), np.ones((3, 2))
    for dtype, big in (("float16", 70000.0), ("float16", 65520.0), ("bfloat16", 3.4e38),
                       ("float32", 1e39), ("bfloat16", 1e39)):
        for which in ("a", "b"):
            aa, bb = a.copy(), b.copy()
            (aa if which == "a" else bb)[1, 1] = -big if which == "b" else big
            with pytest.raises(ValueError, match="overflow") as info:
                lora.LoraDelta(aa, bb, dtype=dtype)
            assert dtype in str(info.value)
    # the largest values that round to a finite number are accepted
    d = lora.LoraDelta(np.full((2, 4), 65519.0), b, dtype="float16")
    assert np.all(d.lora_weights()[0].astype(np.float64) == 65504.0)


def test_unknown_dtype_refused():
    for bad in ("float8", "float64", "int8", np.float64, "fp16", None, 16):
        with pytest.raises(ValueError) as info:
            lora.LoraDelta(np.ones((2, 4)), np.ones((3, 2)), dtype=bad)
        assert "float32" in str(info.value)
    # the NumPy dtypes of the three storage types are accepted and reported as strings
    assert lora.LoraDelta(np.ones((2, 4)), np.ones((3, 2)), dtype=np.float16).dtype == "float16"


def test_set_num_threads_refuses_bad_counts():
    for bad in (0, -1, -2**40):
        with pytest.raises(ValueError, match=str(bad)):
            lora.set_num_threads(bad)
    for bad in (1.5, "2", None, True):
        with pytest.raises(TypeError):
            lora.set_num_threads(bad)


def test_stack_shape_mismatch():
    rng = np.random.default_rng(26)
    d = _delta(rng, 1.0)
    other = _delta(rng, 1.0, cols=COLS + 1)
    with pytest.raises(lora.LoraShapeError) as info:
        lora.LoraStack([d, other])
    assert f"[{ROWS} x {COLS}]" in str(info.value) and f"[{ROWS} x {COLS + 1}]" in str(info.value)
    st = lora.LoraStack([d])
    with pytest.raises(lora.LoraShapeError):
        st.append(_delta(rng, 1.0, rows=ROWS + 2))
    assert len(st) == 1 and st[0] is d
    with pytest.raises(TypeError):
        st.append(np.zeros((2, 2)))
    assert len(st) == 1


def test_bank_shape_mismatch():
    rng = np.random.default_rng(27)
    d = _delta(rng, 1.0)
    for other in (_delta(rng, 1.0, cols=COLS + 1), lora.LoraStack([_delta(rng, 1.0, rows=2)])):
        with pytest.raises(lora.LoraShapeError) as info:
            lora.LoraBank([d, None, other])
        assert f"[{ROWS} x {COLS}]" in str(info.value)
    with pytest.raises(TypeError):
        lora.LoraBank([d, "adapter"])


def test_merge_bad_targets(scale):
    rng = np.random.default_rng(28)
    d = _delta(rng, scale)
    w = rand(rng, (ROWS, COLS))
    rejects(TypeError, ["float64"], lambda: d.merge_into(w.astype(np.float64)))
    rejects(TypeError, ["list"], lambda: d.unmerge_from(w.tolist()))
    bad = rand(rng, (COLS, ROWS))
    rejects(ValueError, [str((COLS, ROWS))], lambda: d.merge_into(bad), bad)
    ro = w.copy()
    ro.flags.writeable = False
    rejects(ValueError, ["read-only"], lambda: d.merge_into(ro), ro)
    big = rand(rng, (ROWS, 2 * COLS))
    rejects(ValueError, [], lambda: d.unmerge_from(big[:, ::2]), big)


def test_errors_are_the_documented_types():
    assert issubclass(lora.LoraShapeError, ValueError)
    assert issubclass(lora.LoraFormatError, ValueError)


def test_failed_call_then_good_call_is_exact():
    """An error leaves nothing behind: the next good call gives the same bits as a fresh run."""
    rng = np.random.default_rng(29)
    d = _delta(rng, 1.0)
    x = rand(rng, (N, COLS))
    out = rand(rng, (N, ROWS))
    expect = out.copy()
    d.add_batch_to(x, expect)
    with pytest.raises(ValueError):
        d.add_batch_to(x[:, :-1], out)
    with pytest.raises(IndexError):
        d.add_rows_to([0, 99], rand(rng, (2, COLS)))
    d.add_batch_to(x, out)
    assert_same_bits(out, expect)


def test_storage_overflow_is_a_value_error_even_with_warnings_as_errors():
    """The overflow check must not go through a NumPy cast warning: under
    ``-W error`` (or pytest's ``filterwarnings = error``) the caller still gets the documented
    ValueError, not a RuntimeWarning raised from inside the conversion."""
    for dtype, big in (("float16", 70000.0), ("bfloat16", 1e39), ("float32", 1e39)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match="overflow"):
                lora.LoraDelta(np.full((2, 4), big), np.ones((3, 2)), dtype=dtype)


def test_unrepresentable_alpha_and_scale_are_value_errors():
    """An alpha or scale too large for a float (e.g. the int 10**400) is not finite as a float:
    the documented ValueError, not an OverflowError (which is no ValueError)."""
    a, b = np.ones((2, 4)), np.ones((3, 2))
    with pytest.raises(ValueError):
        lora.LoraScale(10**400)
    with pytest.raises(ValueError):
        lora.LoraDelta(a, b, scale=10**400)
    with pytest.raises(ValueError):
        lora.LoraDelta(a, b, alpha=10**400)
    s = lora.LoraScale(0.5)
    with pytest.raises(ValueError):
        s.set(-10**400)
    assert s.value == 0.5


# ------------------------------------------------------------- no crashes

CRASH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_crash_inputs.py")


@pytest.fixture(scope="module")
def crash_runs():
    runs = {}
    for name in ISAS:
        runs[name] = subprocess.run([PYTHON, CRASH_SCRIPT], env=subprocess_env(LORA_ISA=name),
                                    capture_output=True, text=True, timeout=300)
    return runs


def test_bad_inputs_never_crash(crash_runs):
    """Every bad and nasty input (huge ids, int64 min, uint64 max, zero-size batches, 0-d arrays,
    big-endian float32, misaligned and broadcast arrays, ...) on every ISA path: the child
    interpreter finishes normally — no segfault, abort or hang."""
    for name, p in crash_runs.items():
        assert p.returncode == 0, (name, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
        assert p.stdout.strip().splitlines()[-1].startswith("DONE "), (name, p.stdout[-2000:])


def test_bad_inputs_raise_documented_types_and_keep_out(crash_runs):
    """...and each one either works or raises TypeError/ValueError/IndexError with `out`
    untouched."""
    for name, p in crash_runs.items():
        bad = [ln for ln in p.stdout.splitlines() if ln.startswith(("UNEXPECTED", "CHANGED"))]
        assert not bad, (name, bad)


# ------------------------------------------------------------ misaligned views


def _misaligned(shape):
    """A float32 view at a 1-byte offset: legal NumPy, but C may not read it as float."""
    n = int(np.prod(shape))
    return np.frombuffer(bytearray(4 * n + 1), np.float32, count=n, offset=1).reshape(shape)


def test_misaligned_x_is_copied_and_misaligned_out_refused(isa):
    rng = np.random.default_rng(31)
    d = lora.LoraDelta(rng.standard_normal((3, COLS)), rng.standard_normal((ROWS, 3)))
    x = _misaligned((2, COLS))
    x[...] = rng.standard_normal((2, COLS))
    assert not x.flags.aligned
    want = np.zeros((2, ROWS), np.float32)
    d.add_batch_to(np.array(x), want)
    got = np.zeros((2, ROWS), np.float32)
    assert d.add_batch_to(x, got) is got
    np.testing.assert_array_equal(got, want)
    got1 = np.zeros(ROWS, np.float32)
    d.add_to(x[0], got1)
    np.testing.assert_array_equal(got1, want[0])
    out = _misaligned((2, ROWS))
    out[...] = 1.5
    rejects(ValueError, ["aligned"], lambda: d.add_batch_to(np.array(x), out), out)
    rejects(ValueError, ["aligned"], lambda: d.add_to(np.array(x[0]), out[0]), out)
    rejects(ValueError, ["aligned"], lambda: d.add_rows_to([0, 1], _misaligned((2, COLS))))


# ------------------------------------------------- found by the new-user trial


def test_bank_sees_a_stack_filled_after_construction():
    d = lora.LoraDelta(np.ones((2, 5)), np.ones((6, 2)))
    stack = lora.LoraStack()
    bank = lora.LoraBank([None, stack])
    stack.append(d)
    out = np.zeros((2, 6), np.float32)
    bank.add_batch_to(np.ones((2, 5), np.float32), out, [1, -1])
    np.testing.assert_array_equal(out[0], d.add_to(np.ones(5, np.float32), np.zeros(6, np.float32)))
    assert not out[1].any()


@pytest.mark.parametrize("alpha,scale", [(1e300, 1e30), (1e30, 1e10)])
def test_non_finite_effective_scale_is_refused(alpha, scale):
    """A product of alpha factor and scale that is not finite in float32 (past a double's range,
    or only past float32's): ValueError and out untouched, for the kernels and the offline merges
    alike.  (A scale that is itself past float32's range is refused by LoraScale.)"""
    d = lora.LoraDelta(np.ones((2, 5)), np.ones((6, 2)), alpha=alpha, scale=scale)
    out = rand(np.random.default_rng(40), 6)
    rejects(ValueError, ["scale"], lambda: d.add_to(np.ones(5, np.float32), out), out)
    w = rand(np.random.default_rng(41), (6, 5))
    rejects(ValueError, ["scale"], lambda: d.merge_into(w), w)
    rejects(ValueError, ["scale"], lambda: lora.LoraStack([d]).add_to(np.ones(5), out), out)


def test_effective_scale_finite_only_after_rounding_is_accepted_everywhere():
    """A double a hair past FLT_MAX that rounds to FLT_MAX in float32 is a finite scale, for the
    kernels and the offline ops alike (one rule); the next double that rounds to inf is not."""
    flt_max = float(np.finfo(np.float32).max)
    edge = np.nextafter(2.0 ** 128 - 2.0 ** 103, 0.0)  # the largest double rounding to FLT_MAX
    assert np.float32(edge) == flt_max and edge > flt_max
    zero_a = np.zeros((2, 5))  # B @ A == 0: the sums stay finite at any scale
    d = lora.LoraDelta(zero_a, np.ones((6, 2)), alpha=edge / 1e3 * 2, scale=1e3)
    assert d.effective_scale > flt_max
    out = rand(np.random.default_rng(44), 6)
    before = out.copy()
    d.add_to(np.ones(5, np.float32), out)
    np.testing.assert_array_equal(out, before)
    w = rand(np.random.default_rng(45), (6, 5))
    w0 = w.copy()
    d.merge_into(w)
    np.testing.assert_array_equal(w, w0)
    assert not d.delta_weight().any()
    over = lora.LoraDelta(zero_a, np.ones((6, 2)), alpha=2.0 ** 128 / 1e3 * 2, scale=1e3)
    rejects(ValueError, ["scale"], lambda: over.merge_into(w), w)
    rejects(ValueError, ["scale"], lambda: over.add_to(np.ones(5, np.float32), out), out)


@pytest.mark.parametrize("kwargs,exc", [
    (dict(base_shape="65"), ValueError),
    (dict(base_shape=(6.9, 5.2)), TypeError),
    (dict(alpha="16"), TypeError),
    (dict(rslora="False"), TypeError),
])
def test_constructor_arguments_are_not_coerced(kwargs, exc):
    with pytest.raises(exc):
        lora.LoraDelta(np.ones((2, 5)), np.ones((6, 2)), **kwargs)


def test_from_flat_dims_must_be_integers():
    with pytest.raises(TypeError):
        lora.LoraDelta.from_flat(np.ones(10), np.ones(12), 3.7, 6, 5)


def test_huge_ids_in_a_list_are_index_errors():
    d = lora.LoraDelta(np.ones((2, 5)), np.ones((6, 2)))
    out = rand(np.random.default_rng(42), (2, 5))
    rejects(IndexError, ["1180591620717411303424", "position 1"],
            lambda: d.add_rows_to([0, 2**70], out), out)


def test_empty_containers_still_check_x():
    out = rand(np.random.default_rng(43), 3)
    rejects(TypeError, ["x"], lambda: lora.LoraStack().add_to(None, out), out)
    with pytest.raises(TypeError):
        lora.LoraStack().merge_into("junk")


def test_omp_thread_limit_caps_the_reported_threads():
    if not lora.kernel_info()["openmp"]:
        pytest.skip("serial build")
    code = "import lora, sys; print(lora.get_num_threads(), lora._lora_cffi.lib.lora_probe_threads())"
    env = dict(subprocess_env(), OMP_THREAD_LIMIT="1")
    res = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.stdout.split() == ["1", "1"], res.stderr


def test_an_empty_id_array_is_fine_whatever_its_dtype():
    """No id, nothing to misread: an empty float64 (NumPy's default), float32, bool or uint64
    array is accepted like ``[]`` (a float id in a non-empty array is still a TypeError)."""
    d = _delta(np.random.default_rng(5), 1.0)
    bank = lora.LoraBank([d])
    for ids in (np.array([]), np.array([], np.float32), [], np.array([], bool),
                np.array([], np.uint64)):
        assert d.add_rows_to(ids, np.zeros((0, COLS), np.float32)).shape == (0, COLS)
        assert bank.add_rows_to(ids, np.zeros((0, COLS), np.float32), ids).shape == (0, COLS)
    rejects(TypeError, ["integers", "float64"],
            lambda: d.add_rows_to(np.array([1.0]), np.zeros((1, COLS), np.float32)))
