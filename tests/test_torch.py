"""CPU torch tensors as activations, outputs, ids, scales and merge targets: read and written in
place through their pointers (never copied for `out`, never through `.numpy()`), the very tensor
returned, the same bits as the NumPy arrays holding the same values, the same refusals."""

import subprocess
import warnings

import numpy as np
import pytest

import lora
from conftest import PYTHON, assert_same_bits, make_delta, subprocess_env

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
ROWS, COLS = 37, 53


def as_np(t):
    """A NumPy copy of a tensor's values (bfloat16 through its bits)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(BF16)
    return t.numpy().copy()


def as_torch(a):
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _rand(gen, shape, name, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(TORCH[name])


@pytest.mark.parametrize("xdt", list(TORCH))
@pytest.mark.parametrize("odt", list(TORCH))
def test_tensors_give_the_bits_of_numpy(xdt, odt, isa, dtype):
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    d = make_delta(rng, 8, ROWS, COLS, dtype, alpha=4.0)
    stack = lora.LoraStack([d, make_delta(rng, 3, ROWS, COLS, dtype)])
    bank = lora.LoraBank([d, stack])
    x = _rand(gen, (2, 3, COLS), xdt)
    out = _rand(gen, (2, 3, ROWS), odt)
    ids = torch.tensor([[0, 1, -1], [1, 1, 0]])
    sc = torch.tensor([[0.5, 2.0, 1.0], [1.0, -1.0, 0.25]], dtype=torch.float64)
    calls = {
        "delta": (lambda xx, o: d.add_batch_to(xx, o)),
        "stack": (lambda xx, o: stack.add_batch_to(xx, o)),
        "bank": (lambda xx, o: bank.add_batch_to(xx, o, ids, sc)),
        "bank np ids": (lambda xx, o: bank.add_batch_to(xx, o, ids.numpy(), sc.numpy())),
    }
    for name, call in calls.items():
        got = out.clone()
        ptr = got.data_ptr()
        assert call(x, got) is got
        assert got.data_ptr() == ptr
        want = call(as_np(x), as_np(out))
        assert_same_bits(as_np(got).view(np.uint8), want.view(np.uint8), name)
    # decode and gathers
    got = out[0, 0].clone()
    d.add_to(x[1, 2], got)
    want = d.add_to(as_np(x[1, 2]), as_np(out[0, 0]))
    assert_same_bits(as_np(got).view(np.uint8), want.view(np.uint8))
    tok = torch.tensor([[3, 0, 36], [5, 5, 1]])
    rows_out = _rand(gen, (2, 3, COLS), odt)
    got = stack.add_rows_to(tok, rows_out.clone())
    want = stack.add_rows_to(tok.numpy(), as_np(rows_out))
    assert_same_bits(as_np(got).view(np.uint8), want.view(np.uint8))
    got = bank.add_rows_to(tok, rows_out.clone(), ids)
    want = bank.add_rows_to(tok.numpy(), as_np(rows_out), ids.numpy())
    assert_same_bits(as_np(got).view(np.uint8), want.view(np.uint8))
    row = rows_out[0, 0].clone()
    d.add_row_to(torch.tensor(5), row)
    assert_same_bits(as_np(row).view(np.uint8),
                     d.add_row_to(5, as_np(rows_out[0, 0])).view(np.uint8))


def test_row_strided_torch_views_are_written_in_place(isa):
    """The q columns of a fused qkv output, and an x that is a slice of a wider tensor."""
    gen = torch.Generator().manual_seed(2)
    rng = np.random.default_rng(2)
    d = make_delta(rng, 8, ROWS, COLS, "bfloat16")
    qkv = _rand(gen, (2, 4, 3 * ROWS), "bfloat16")
    x = _rand(gen, (2, 4, 2 * COLS), "bfloat16")[:, :, COLS:]
    want = as_np(qkv)
    want[:, :, :ROWS] = d.add_batch_to(as_np(x), want[:, :, :ROWS].copy())
    q = qkv[:, :, :ROWS]
    assert d.add_batch_to(x, q) is q
    assert_same_bits(as_np(qkv).view(np.uint16), want.view(np.uint16))


def test_x_that_requires_grad_is_read_and_params_merge():
    rng = np.random.default_rng(3)
    d = make_delta(rng, 4, ROWS, COLS, alpha=2.0)
    x = torch.randn(COLS, requires_grad=True)
    out = torch.zeros(ROWS)
    d.add_to(x, out)
    assert_same_bits(as_np(out), d.add_to(as_np(x), np.zeros(ROWS, np.float32)))
    w = torch.nn.Parameter(torch.randn(ROWS, COLS, dtype=torch.bfloat16))
    before = as_np(w).astype(np.float64)
    assert d.merge_into(w) is w
    a, b = d.lora_weights()
    expect = before + d.effective_scale * (b.astype(np.float64) @ a.astype(np.float64))
    assert np.abs(as_np(w).astype(np.float64) - expect).max() <= np.abs(expect).max() * 2**-8
    # the transposed view of a contiguous [cols, rows] tensor (fan_in_fan_out bases)
    wt = torch.randn(COLS, ROWS, dtype=torch.float16)
    np_wt = as_np(wt)
    d.merge_into(wt.T)
    assert_same_bits(as_np(wt), d.merge_into(np_wt.T).T.copy())


def _bad_calls(d, bank):
    x = torch.randn(3, COLS)
    good = torch.zeros(3, ROWS)
    grad = torch.zeros(3, ROWS, requires_grad=True)
    meta_out = torch.zeros(3, ROWS, device="meta")
    meta_x = torch.zeros(3, COLS, device="meta")
    yield "meta out", TypeError, ["meta"], lambda o: d.add_batch_to(x, meta_out), good
    yield "meta x", TypeError, ["meta"], lambda o: d.add_batch_to(meta_x, o), good
    yield "grad out", ValueError, ["requires grad"], lambda o: d.add_batch_to(x, grad), good
    yield "int out", TypeError, ["float32", "int64"], \
        lambda o: d.add_batch_to(x, torch.zeros(3, ROWS, dtype=torch.int64)), good
    yield "int x", TypeError, ["int32"], \
        lambda o: d.add_batch_to(torch.zeros(3, COLS, dtype=torch.int32), o), good
    yield "complex x", TypeError, ["complex"], \
        lambda o: d.add_batch_to(torch.zeros(3, COLS, dtype=torch.complex64), o), good
    yield "shape", ValueError, ["(..., 37)", "(3, 38)"], \
        lambda o: d.add_batch_to(x, torch.zeros(3, ROWS + 1)), good
    yield "x shape", ValueError, ["(3, 52)"], lambda o: d.add_batch_to(x[:, :-1], o), good
    yield "not contiguous", ValueError, ["strides"], \
        lambda o: d.add_batch_to(x, torch.zeros(3, 2 * ROWS)[:, ::2]), good
    yield "float ids", TypeError, ["integers"], \
        lambda o: bank.add_batch_to(x, o, torch.zeros(3)), good
    yield "bool scales", TypeError, ["bool"], \
        lambda o: bank.add_batch_to(x, o, torch.zeros(3, dtype=torch.int64),
                                    torch.ones(3, dtype=torch.bool)), good
    yield "id range", IndexError, ["7", "position 1"], \
        lambda o: bank.add_batch_to(x, o, torch.tensor([0, 7, 0])), good
    yield "token range", IndexError, ["99"], \
        lambda o: d.add_rows_to(torch.tensor([1, 99, 2]), o), torch.zeros(3, COLS)
    with warnings.catch_warnings():  # nested tensors are a prototype API: torch says so
        warnings.simplefilter("ignore", UserWarning)
        ragged_x = torch.nested.nested_tensor([torch.ones(COLS), torch.ones(COLS)])
        ragged_out = torch.nested.nested_tensor([torch.ones(ROWS), torch.ones(ROWS)])
    yield "nested x", TypeError, ["nested"], lambda o: d.add_batch_to(ragged_x, o), good
    yield "nested out", TypeError, ["nested"], lambda o: d.add_batch_to(x, ragged_out), good
    yield "nested gather out", TypeError, ["nested"], \
        lambda o: d.add_rows_to([0, 1], ragged_out), good
    yield "ragged list x", ValueError, ["one shape"], \
        lambda o: d.add_batch_to([[1.0] * COLS, [1.0]], o), good
    buf = torch.zeros(3 * ROWS + 3 * COLS)
    yield "overlap", ValueError, ["overlap"], \
        lambda o: d.add_batch_to(buf[:3 * COLS].view(3, COLS), buf[3 * COLS - 5:][:3 * ROWS]
                                 .view(3, ROWS)), buf


def test_bad_tensors_are_refused_and_nothing_is_written(isa):
    rng = np.random.default_rng(4)
    d = make_delta(rng, 4, ROWS, COLS)
    bank = lora.LoraBank([d])
    for name, exc, fragments, call, watched in _bad_calls(d, bank):
        before = watched.clone()
        with pytest.raises(exc) as info:
            call(watched)
        for frag in fragments:
            assert frag in str(info.value), (name, str(info.value))
        assert torch.equal(watched, before), name


def test_torch_dtypes_name_the_storage_dtype():
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((2, 5)), rng.standard_normal((3, 2))
    for t, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                    (torch.float32, "float32")):
        assert lora.LoraDelta(a, b, dtype=t).dtype == name
    with pytest.raises(ValueError, match="torch.int8"):
        lora.LoraDelta(a, b, dtype=torch.int8)


def test_half_merge_overflow_in_torch_leaves_w():
    d = lora.LoraDelta(np.ones((1, 4)), np.ones((3, 1)), scale=70000.0)
    w = torch.ones(3, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="overflow"):
        d.merge_into(w)
    assert torch.equal(w, torch.ones(3, 4, dtype=torch.float16))


def test_merge_into_one_row_or_column_tensors_follows_their_strides():
    """A weight of one row or one column is read through its strides like any other: a slice of
    a bigger tensor that is contiguous is merged in place, one with a stride (a column of a
    matrix, every other element) or an expanded one (stride 0) is refused, nothing written."""
    col = lora.LoraDelta(np.ones((1, 1)), np.arange(1.0, 5.0).reshape(4, 1))  # 4 x 1
    row = lora.LoraDelta(np.arange(1.0, 6.0).reshape(1, 5), np.ones((1, 1)))  # 1 x 5
    big = torch.zeros(3, 5)
    row.merge_into(big[1:2, :])
    assert big[1].tolist() == [1, 2, 3, 4, 5] and not big[0].any() and not big[2].any()
    tall = torch.zeros(4, 1)
    col.merge_into(tall)
    assert tall[:, 0].tolist() == [1, 2, 3, 4]
    for delta, target, view in (
            (col, torch.zeros(4, 5), lambda t: t[:, :1]),    # a column: stride 5
            (row, torch.zeros(3, 10), lambda t: t[:1, ::2]),  # every other element: stride 2
            (col, torch.zeros(1, 1), lambda t: t.expand(4, 1)),  # stride 0
            (row, torch.zeros(1, 1), lambda t: t.expand(1, 5))):
        before = target.clone()
        with pytest.raises(ValueError, match="C-contiguous"):
            delta.merge_into(view(target))
        assert torch.equal(target, before)


def test_merge_into_the_transposed_view_of_a_parameter_that_requires_grad():
    """fan_in_fan_out bases (GPT-2 Conv1D) hold W as [in, out]: W.T is a view of a leaf."""
    rng = np.random.default_rng(9)
    d = make_delta(rng, 3, 4, 6, alpha=2.0)
    weight = torch.nn.Parameter(torch.randn(6, 4))
    want = weight.detach().numpy().T.astype(np.float64) + d.effective_scale * (
        d.lora_weights()[1].astype(np.float64) @ d.lora_weights()[0].astype(np.float64))
    assert d.merge_into(weight.T) is not None
    np.testing.assert_array_equal(weight.detach().numpy().T, want.astype(np.float32))
    inner = weight * 2  # a non-leaf in a graph: still refused
    with pytest.raises(ValueError, match="non-leaf"):
        d.merge_into(inner.T)


def test_bank_with_tensors_takes_strided_numpy_ids():
    """Strided int64 ids (a slice) with torch x/out are read by value, as with NumPy x/out."""
    rng = np.random.default_rng(10)
    d = make_delta(rng, 4, ROWS, COLS)
    bank = lora.LoraBank([d, None])
    ids = np.array([0, 9, 1, 9, 0, 9], np.int64)[::2]
    assert not ids.flags.c_contiguous
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(1))
    out = torch.zeros(3, ROWS)
    bank.add_batch_to(x, out, ids)
    want = np.zeros((3, ROWS), np.float32)
    bank.add_batch_to(x.numpy(), want, np.ascontiguousarray(ids))
    assert_same_bits(out.numpy(), want)


def test_import_lora_does_not_import_torch():
    code = "import sys, lora; print('torch' in sys.modules)"
    res = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert res.stdout.strip() == "False", res.stderr


def test_in_place_writes_are_seen_by_autograd():
    """Under grad mode a write into `out` bumps its version counter, as torch's in-place ops do:
    a backward that saved `out` raises instead of using the new values silently."""
    d = lora.LoraDelta(np.ones((2, 16), np.float32), np.ones((8, 2), np.float32))
    for call in (lambda o: d.add_to(torch.ones(16), o),
                 lambda o: d.add_batch_to(torch.ones(1, 16), o.view(1, 8)),
                 lambda o: lora.LoraStack([d]).add_to(torch.ones(16), o)):
        out = torch.zeros(8)
        w = torch.ones(8, requires_grad=True)
        loss = (out * w).sum()  # saves out for backward
        call(out)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    # merges: a Parameter's version moves; a non-leaf that requires grad is refused
    p = torch.nn.Parameter(torch.ones(8, 16))
    v = p._version
    d.merge_into(p)
    assert p._version > v
    y = p * 1
    with pytest.raises(ValueError, match="non-leaf"):
        d.merge_into(y)


def test_ids_and_scales_inside_out_are_read_before_any_write(isa):
    """Token ids, adapter ids or scales that are views of out's own memory are copied first:
    the result is the one their copies give (never a crash, never ids read after a write)."""
    rng = np.random.default_rng(9)
    d = lora.LoraDelta(rng.standard_normal((8, 48)), rng.standard_normal((1000, 8)))
    for n in (8, 100):
        for make in (np.zeros, lambda shape, dt: torch.zeros(shape, dtype=torch.float32)):
            out = make((n, 48), np.float32)
            flat = out.reshape(-1)
            ids = flat[:2 * n].view(np.int64) if isinstance(out, np.ndarray) else \
                flat[:2 * n].view(torch.int64)
            ids[:] = torch.as_tensor(rng.integers(0, 1000, n)) if isinstance(out, torch.Tensor) \
                else rng.integers(0, 1000, n)
            as_np = (lambda t: t.numpy().copy()) if isinstance(out, torch.Tensor) else np.copy
            want = d.add_rows_to(as_np(ids), as_np(out))
            got = d.add_rows_to(ids, out)
            assert as_np(got).tobytes() == want.tobytes()  # bits: out may hold NaNs
    dd = lora.LoraDelta(rng.standard_normal((8, 48)), rng.standard_normal((48, 8)))
    bank = lora.LoraBank([dd, None, dd])
    x = rng.standard_normal((100, 48)).astype(np.float32)
    out = np.zeros((100, 48), np.float32)
    sc = out.reshape(-1)[:200].view(np.float64)
    sc[:] = 0.5
    aid = out.reshape(-1)[200:400].view(np.int64)
    aid[:] = rng.integers(-1, 3, 100)
    want = bank.add_batch_to(x, out.copy(), aid.copy(), sc.copy())
    assert bank.add_batch_to(x, out, aid, sc).tobytes() == want.tobytes()



def test_lazily_negated_views_are_read_by_value_and_never_written():
    """The imaginary part of a conjugated complex tensor is a view with torch's neg bit: its
    memory holds -value.  As x, ids, scales or delta factors it is read by value (one element
    included, where the view counts as contiguous); as out or w it is refused, untouched."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(3, 4, dtype=torch.complex64, generator=gen).conj().imag  # [rank, cols]
    b = torch.randn(5, 3, dtype=torch.complex64, generator=gen).conj().imag  # [rows, rank]
    assert a.is_neg() and b.is_neg()
    d = lora.LoraDelta(a, b)
    a_np, b_np = d.lora_weights()
    np.testing.assert_array_equal(a_np, a.resolve_neg().numpy())
    np.testing.assert_array_equal(b_np, b.resolve_neg().numpy())
    x = torch.randn(2, 4, dtype=torch.complex64, generator=gen).conj().imag
    want = x.resolve_neg().numpy().astype(np.float64) @ a_np.T.astype(np.float64) @ b_np.T
    out = torch.zeros(2, 5)
    d.add_batch_to(x, out)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    out = torch.zeros(5)
    d.add_to(x[0], out)
    np.testing.assert_allclose(out.numpy(), want[0], rtol=1e-5, atol=1e-6)
    # one element: cols == 1 and rows == 1, the view is contiguous
    one = lora.LoraDelta(np.ones((1, 1)), np.ones((1, 1)))
    x1 = torch.tensor([2 + 3j], dtype=torch.complex64).conj().imag  # holds 3, reads -3
    assert x1.is_contiguous() and x1.is_neg()
    out1 = torch.zeros(1)
    one.add_to(x1, out1)
    assert out1.item() == -3.0
    out1 = torch.zeros(1, 1)
    one.add_batch_to(x1.reshape(1, 1), out1)
    assert out1.item() == -3.0
    # ids and per-position scales
    bank = lora.LoraBank([d, None])
    ids = torch.tensor([0, -0], dtype=torch.int64)
    sc = torch.tensor([1 + 2j, 1 - 0.5j], dtype=torch.complex128).conj().imag  # -2.0, 0.5
    out = torch.zeros(2, 5)
    bank.add_batch_to(x, out, ids, sc)
    np.testing.assert_allclose(out.numpy(), want * np.array([[-2.0], [0.5]]), rtol=1e-5,
                               atol=1e-6)
    # out and w: refused, untouched
    for call, target in (
            (lambda t: d.add_batch_to(x, t), torch.zeros(2, 5, dtype=torch.complex64)),
            (lambda t: d.add_to(x[0], t), torch.zeros(5, dtype=torch.complex64)),
            (lambda t: one.add_to(x1, t), torch.zeros(1, dtype=torch.complex64)),
            (lambda t: d.merge_into(t), torch.zeros(5, 4, dtype=torch.complex64))):
        neg = target.conj().imag
        before = target.clone()
        with pytest.raises(ValueError, match="negated"):
            call(neg)
        assert torch.equal(target, before)


def test_contiguous_negated_views_never_take_the_fast_path():
    """torch's `_neg_view()` makes a *contiguous* view with the neg bit (memory -value): the
    tensor fast paths, which read memory directly, must leave it to the checked path, so x is
    read by value and out is refused untouched (decode, batch, routed experts)."""
    gen = torch.Generator().manual_seed(3)
    d = lora.LoraDelta(torch.randn(2, 5, generator=gen), torch.randn(6, 2, generator=gen))
    x = torch.randn(5, generator=gen)
    want = d.add_to(x, torch.zeros(6))
    xn = (-x)._neg_view()
    assert xn.is_contiguous() and xn.is_neg()
    assert torch.equal(d.add_to(xn, torch.zeros(6)), want)
    on = torch.zeros(6)._neg_view()
    with pytest.raises(ValueError, match="negated"):
        d.add_to(x, on)
    xb = torch.randn(3, 5, generator=gen)
    wantb = d.add_batch_to(xb, torch.zeros(3, 6))
    assert torch.equal(d.add_batch_to((-xb)._neg_view(), torch.zeros(3, 6)), wantb)
    with pytest.raises(ValueError, match="negated"):
        d.add_batch_to(xb, torch.zeros(3, 6)._neg_view())
    ex = lora.LoraExperts(np.asarray(torch.randn(4, 2, 5, generator=gen)),
                          np.asarray(torch.randn(4, 6, 2, generator=gen)))
    ids = torch.tensor([[0, 3], [2, -1]], dtype=torch.int64)
    xe = torch.randn(2, 5, generator=gen)
    wante = ex.add_to(xe, torch.zeros(2, 2, 6), ids)
    assert torch.equal(ex.add_to((-xe)._neg_view(), torch.zeros(2, 2, 6), ids), wante)
    assert torch.equal(ex.add_to(xe, torch.zeros(2, 2, 6), (-ids)._neg_view()), wante)
    with pytest.raises(ValueError, match="negated"):
        ex.add_to(xe, torch.zeros(2, 2, 6)._neg_view(), ids)
