"""The one edge (lora._edge.apply): the common case (NumPy arrays or plain CPU tensors of the op's
shapes, the last axis contiguous, dtypes the kernels read) is taken in C and gives the bits of a
lora_call made through cffi on the same memory; everything else is declined to the checked path
(lora._apply), which still raises or converts as before; the entry survives any argument the
Python layer could hand it."""

import warnings

import numpy as np
import pytest

import lora
import lora.kinds.delta as delta_mod
from lora import _apply, _edge
from lora._lora_cffi import ffi, lib
from conftest import assert_same_bits, make_delta

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
CODE = {"float32": lib.LORA_DTYPE_F32, "float16": lib.LORA_DTYPE_F16,
        "bfloat16": lib.LORA_DTYPE_BF16}
ROWS, COLS, RANK = 37, 53, 5
DECLINE = _edge.DECLINE


@pytest.fixture
def d():
    return make_delta(np.random.default_rng(7), RANK, ROWS, COLS, alpha=2.0 * RANK, scale=0.75)


def _arrays(rng, lead, xdt, odt):
    x = rng.standard_normal(lead + (COLS,)).astype(NP[xdt])
    out = rng.standard_normal(lead + (ROWS,)).astype(NP[odt])
    return x, out


def _cffi_ref(d, x, out):
    """The same call through cffi on copies: one lora_call of a table of one entry."""
    x, out = x.copy(), out.copy()
    c = ffi.new("lora_call *")
    first = ffi.new("int64_t[2]", [0, 1])
    ptrs = ffi.new("lora_delta *[1]", [d._ptr])
    sc = ffi.new("double[1]", [float(np.float32(d._scale._value * d._alpha_factor))])
    c.op, c.n_entries, c.first, c.deltas, c.scales = lib.LORA_OP_PROJECT, 1, first, ptrs, sc
    c.rows, c.cols, c.n = ROWS, COLS, max(x.size // COLS, 1)
    c.x, c.x_dtype, c.ldx = ffi.from_buffer(x), CODE[x.dtype.name], COLS
    c.out, c.out_dtype, c.ldo = ffi.from_buffer(out, require_writable=True), CODE[out.dtype.name], ROWS
    assert lib.lora_apply(c) == 0
    return out


def _edge_call(d, op, x, out, scale=None):
    """lora._edge.apply on a delta's own view: 0, DECLINE or (status, bad)."""
    s = d._scale._value * d._alpha_factor if scale is None else scale
    return _edge.apply(d.edge_view(), s, op, x, out, None, None, None, None)


def _counting(monkeypatch, name="_edge_apply"):
    """Wrap lora.kinds.delta's binding of the edge: the statuses it returned, in order."""
    seen = []
    real = getattr(delta_mod, name)

    def wrapper(*args):
        st = real(*args)
        seen.append(st)
        return st

    monkeypatch.setattr(delta_mod, name, wrapper)
    return seen


@pytest.mark.parametrize("xdt", list(NP))
@pytest.mark.parametrize("odt", list(NP))
@pytest.mark.parametrize("lead", [(), (4,), (2, 3)])
def test_ndarrays_take_the_edge_with_the_cffi_bits(d, monkeypatch, xdt, odt, lead):
    rng = np.random.default_rng(1)
    x, out = _arrays(rng, lead, xdt, odt)
    ref = _cffi_ref(d, x, out)
    method = "add_to" if not lead else "add_batch_to"
    getattr(d, method)(x.copy(), out.copy())  # bfloat16 joins the fast dtypes at its first array
    seen = _counting(monkeypatch)
    assert getattr(d, method)(x, out) is out
    assert seen == [0]  # taken in C, not declined to the Python paths
    assert_same_bits(out, ref)


def test_a_nonnative_or_strided_array_is_declined_and_still_right(d, monkeypatch):
    rng = np.random.default_rng(2)
    x, out = _arrays(rng, (), "float32", "float32")
    ref = _cffi_ref(d, x, out)
    seen = _counting(monkeypatch)
    cases = [(x.astype(">f4"), out.copy()),                        # not the canonical dtype object
             (np.repeat(x, 2)[::2], out.copy()),                    # strided x
             (x.astype(np.float64), out.copy())]                    # converted by the checked path
    for xi, oi in cases:
        d.add_to(xi, oi)
        assert_same_bits(oi, ref)
    big = np.repeat(out, 2)
    with pytest.raises(ValueError, match="C-contiguous"):          # strided out: refused
        d.add_to(x, big[::2])
    assert_same_bits(big, np.repeat(out, 2))
    assert seen == [DECLINE] * 4


def test_declines_leave_the_checked_paths_errors(d):
    x = np.ones(COLS, np.float32)
    ro = np.zeros(ROWS, np.float32)
    ro.flags.writeable = False
    cases = [(x, ro, ValueError),
             (np.ones(COLS + 1, np.float32), np.zeros(ROWS, np.float32), ValueError),
             (x, np.zeros(ROWS, np.int32), TypeError), (x, [0.0] * ROWS, TypeError)]
    for xi, oi, err in cases:
        assert _edge_call(d, _apply.OP_VEC, xi, oi, 1.0) == DECLINE
        with pytest.raises(err):
            d.add_to(xi, oi)
    assert not ro.any()


def test_overlap_and_bad_scale_come_back_as_c_statuses():
    rng = np.random.default_rng(3)
    sq = make_delta(rng, RANK, COLS, COLS)
    buf = np.ones(COLS, np.float32)
    assert _edge_call(sq, _apply.OP_VEC, buf, buf, 1.0) == (lib.LORA_ERR_OVERLAP, -1)
    with pytest.raises(ValueError):
        sq.add_to(buf, buf)
    assert _edge_call(sq, _apply.OP_VEC, buf, np.zeros(COLS, np.float32), 1e300) == \
        (lib.LORA_ERR_SCALE, -1)


def test_warn_on_write_views_are_declined():
    """NumPy marks some views writeable-with-a-warning (np.broadcast_arrays); its own writeable
    buffer request warns for them, so the edge must decline them.  This pins the flag bit the C
    side reads (it is not in NumPy's public headers)."""
    rng = np.random.default_rng(4)
    dd = make_delta(rng, RANK, ROWS, COLS)
    out, _ = np.broadcast_arrays(np.zeros(ROWS, np.float32), np.zeros((1, ROWS), np.float32))
    assert out.flags.c_contiguous
    x = np.ones((1, COLS), np.float32)
    assert _edge_call(dd, _apply.OP_BATCH, x, out, 1.0) == DECLINE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dd.add_batch_to(x, out)
    assert any(issubclass(w.category, (FutureWarning, DeprecationWarning)) for w in caught)


def test_unaligned_out_is_refused_and_unaligned_x_is_copied(d):
    rng = np.random.default_rng(5)
    x, out = _arrays(rng, (), "float32", "float32")
    ref = _cffi_ref(d, x, out)
    raw = np.zeros(COLS * 4 + 1, np.uint8)
    xo = raw[1:].view(np.float32)
    xo[:] = x
    s = d._scale._value * d._alpha_factor
    assert _edge_call(d, _apply.OP_VEC, xo, out.copy(), s) == (lib.LORA_ERR_ALIGN, -1)
    o = out.copy()
    d.add_to(xo, o)
    assert_same_bits(o, ref)
    oraw = np.zeros(ROWS * 4 + 1, np.uint8)
    with pytest.raises(ValueError, match="aligned"):
        d.add_to(x, oraw[1:].view(np.float32))


def test_empty_batch_is_a_no_op(d, monkeypatch):
    seen = _counting(monkeypatch)
    out = np.zeros((0, ROWS), np.float32)
    assert d.add_batch_to(np.zeros((0, COLS), np.float32), out) is out
    assert seen == [0]


def _view():
    return make_delta(np.random.default_rng(0), RANK, ROWS, COLS).edge_view()


@pytest.mark.parametrize("args", [
    (), (0,), (_view(), 1.0, 0, None), (_view(), 1.0, 0, None, None, None, None, None),
    ((0, 0, 0, ROWS, COLS, 0, -1, 0, 0, 0), 1.0, 0, np.ones(COLS, np.float32),
     np.zeros(ROWS, np.float32), None, None, None, None),                          # not a view
    ("x", 1.0, 0, np.ones(COLS, np.float32), np.zeros(ROWS, np.float32), None, None, None, None),
    (_view(), "s", 0, np.ones(COLS, np.float32), np.zeros(ROWS, np.float32), None, None, None,
     None),
    (_view(), 1.0, 99, np.ones(COLS, np.float32), np.zeros(ROWS, np.float32), None, None, None,
     None),                                                                         # no such op
])
def test_malformed_calls_raise(args):
    """A private module's entry, called only with a live table's view; what it can check (the
    argument count and kinds, a NULL table, an unknown op) raises instead of crashing."""
    with pytest.raises((TypeError, ValueError, OverflowError)):
        _edge.apply(*args)


@pytest.mark.parametrize("args", [(), (1, 0, 0, ROWS, COLS, 0, -1, 0, 0, 0, None),  # NULL first
                                  (1, 8, 8, 0, COLS, 0, -1, 0, 0, 0, None), ("x",) * 11])
def test_a_view_of_nothing_is_refused(args):
    with pytest.raises((TypeError, ValueError)):
        _edge.view(*args)


@pytest.mark.parametrize("args", [(), (0, ROWS, COLS, None), ("x", ROWS, COLS, None),
                                  (8, "r", COLS, None)])
def test_a_view_of_no_delta_is_refused(args):
    with pytest.raises((TypeError, ValueError)):
        _edge.view_of_delta(*args)


def test_setup_refuses_what_is_not_a_type_or_callable():
    i64, f64 = np.dtype(np.int64), np.dtype(np.float64)
    with pytest.raises(TypeError):
        _edge.setup(1, (), i64, f64, 1)
    with pytest.raises(TypeError):
        _edge.setup(np.ndarray, (), i64, f64, (1, 1))
    with pytest.raises(ValueError):
        _edge.setup(np.ndarray, (), i64, f64, 0)
    with pytest.raises((TypeError, ValueError)):
        _edge.add_numpy_dtypes(((np.dtype(">f4"), 99),))
    with pytest.raises(TypeError):
        _edge.setup_torch(np.ndarray, 1, 2, 3)


# ---------------------------------------------------------------- torch tensors

def _torch():
    return pytest.importorskip("torch")


def _as_torch(torch, a):
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _as_np(torch, t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(BF16)
    return t.numpy().copy()


@pytest.mark.parametrize("xdt", list(NP))
@pytest.mark.parametrize("odt", list(NP))
@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
def test_tensors_take_the_edge_with_the_cffi_bits(d, monkeypatch, xdt, odt, lead):
    torch = _torch()
    rng = np.random.default_rng(6)
    x, out = _arrays(rng, lead, xdt, odt)
    ref = _cffi_ref(d, x, out)
    xt, ot = _as_torch(torch, x), _as_torch(torch, out)
    method = "add_to" if not lead else "add_batch_to"
    getattr(d, method)(_as_torch(torch, x), _as_torch(torch, out))  # the first tensor sets torch up
    seen = _counting(monkeypatch)
    assert getattr(d, method)(xt, ot) is ot
    assert seen == [0]
    assert_same_bits(_as_np(torch, ot), ref)


def test_tensor_views_at_an_offset_read_their_own_memory(d):
    torch = _torch()
    rng = np.random.default_rng(8)
    x, out = _arrays(rng, (), "float32", "float32")
    ref = _cffi_ref(d, x, out)
    xb = torch.zeros(COLS + 7)
    xb[5:5 + COLS] = torch.from_numpy(x)
    ob = torch.zeros(ROWS + 9)
    ob[3:3 + ROWS] = torch.from_numpy(out)
    xv, ov = xb[5:5 + COLS], ob[3:3 + ROWS]
    assert _edge_call(d, _apply.OP_VEC, xv, ov) == 0
    assert_same_bits(ov.numpy(), ref)
    assert not ob[:3].any() and not ob[3 + ROWS:].any()


def test_tensors_the_edge_declines(d):
    torch = _torch()
    x, o = torch.ones(COLS), torch.zeros(ROWS)
    d.add_to(x, torch.zeros(ROWS))  # sets torch up
    declined = [
        (torch._neg_view(x), o),                                   # the neg bit
        (torch._efficientzerotensor(COLS), o),                     # no memory
        (torch.ones(COLS, device="meta"), o),
        (x, torch.zeros(ROWS, requires_grad=True)),                # an autograd leaf
        (x, torch.nn.Parameter(torch.zeros(ROWS), requires_grad=False)),  # a subclass
        (torch.ones(2 * COLS)[::2], o),                            # strided
        (x.to_sparse(), o),
        (torch.ones(COLS, dtype=torch.int32), o),
        (torch.ones(COLS, dtype=torch.float64), o),
        (torch.ones(1, COLS), o),                                  # the wrong rank
    ]
    for xi, oi in declined:
        assert _edge_call(d, _apply.OP_VEC, xi, oi, 1.0) == DECLINE
    assert not o.any()


def test_a_tensor_and_an_array_together_take_the_edge(d):
    """x and out are read each on its own: a NumPy x with a tensor out, and the other way."""
    torch = _torch()
    rng = np.random.default_rng(21)
    x, out = _arrays(rng, (3,), "float32", "float32")
    ref = _cffi_ref(d, x, out)
    d.add_to(torch.ones(COLS), torch.zeros(ROWS))  # sets torch up
    for xi, oi in ((x, torch.from_numpy(out.copy())), (torch.from_numpy(x), out.copy())):
        assert _edge_call(d, _apply.OP_BATCH, xi, oi) == 0
        assert_same_bits(np.asarray(oi), ref)


def test_row_strided_views_take_the_edge(d):
    """A row-strided out (the q columns of a fused qkv output) and x are read in place."""
    rng = np.random.default_rng(22)
    x, out = _arrays(rng, (4,), "float32", "float32")
    ref = _cffi_ref(d, x, out)
    wide_x = np.zeros((4, COLS + 5), np.float32)
    wide_x[:, :COLS] = x
    wide = np.zeros((4, ROWS + 11), np.float32)
    wide[:, 3:3 + ROWS] = out
    assert _edge_call(d, _apply.OP_BATCH, wide_x[:, :COLS], wide[:, 3:3 + ROWS]) == 0
    assert_same_bits(wide[:, 3:3 + ROWS], ref)
    assert not wide[:, :3].any() and not wide[:, 3 + ROWS:].any()


def test_neg_view_x_is_resolved_by_the_checked_path(d):
    torch = _torch()
    rng = np.random.default_rng(9)
    x, out = _arrays(rng, (), "float32", "float32")
    ref = _cffi_ref(d, -x, out)
    ot = torch.from_numpy(out.copy())
    d.add_to(torch._neg_view(torch.from_numpy(x.copy())), ot)
    assert_same_bits(ot.numpy(), ref)


def test_tensor_out_is_version_bumped_under_grad_mode_only(d):
    torch = _torch()
    x, o = torch.ones(COLS), torch.zeros(ROWS)
    d.add_to(x, o)
    v = o._version
    assert _edge_call(d, _apply.OP_VEC, x, o, 1.0) == 0
    assert o._version == v + 1
    with torch.no_grad():
        assert _edge_call(d, _apply.OP_VEC, x, o, 1.0) == 0
    assert o._version == v + 1


def test_a_backward_that_saved_out_sees_the_write(d):
    """autograd raises for a tensor written in place after it was saved, as with torch's own
    in-place ops (the edge's version bump)."""
    torch = _torch()
    w = torch.ones(ROWS, requires_grad=True)
    o = torch.zeros(ROWS)
    y = (w * o).sum()  # saves o
    d.add_to(torch.ones(COLS), o)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_tensors_without_memory_are_refused_not_read(d):
    """torch's zero tensors (what autograd makes for an unused gradient) have data_ptr() 0: every
    path refuses them with a TypeError instead of handing address 0 to C."""
    torch = _torch()
    z = torch._efficientzerotensor
    bank = lora.LoraBank([d, d])
    ids = np.array([0, 1])
    calls = [lambda: d.add_to(z(COLS), torch.zeros(ROWS)),
             lambda: d.add_to(torch.ones(COLS), z(ROWS)),
             lambda: d.add_batch_to(z(2, COLS), torch.zeros(2, ROWS)),
             lambda: d.add_batch_to(torch.ones(2, COLS), z(2, ROWS)),
             lambda: bank.add_batch_to(z(2, COLS), torch.zeros(2, ROWS), ids),
             lambda: bank.add_batch_to(torch.ones(2, COLS), z(2, ROWS), ids)]
    for call in calls:
        with pytest.raises(TypeError, match="without memory"):
            call()


# ---------------------------------------------------------------- entry tables (banks, stacks, sets)

import lora._entries as entries_mod  # noqa: E402


def _both_ways(monkeypatch, call, make_out):
    """(out through lora._edge, out through the Python paths alone, the edge's statuses)."""
    seen = []
    real = entries_mod._edge_apply

    def counting(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(entries_mod, "_edge_apply", counting)
    o1 = make_out()
    call(o1)
    monkeypatch.setattr(entries_mod, "_edge_apply", lambda *args: DECLINE)
    o2 = make_out()
    call(o2)
    monkeypatch.setattr(entries_mod, "_edge_apply", real)
    return o1, o2, seen


def _deltas(rng, n=3):
    return [make_delta(rng, RANK, ROWS, COLS, alpha=2.0 * RANK, scale=0.5 + i) for i in range(n)]


@pytest.mark.parametrize("odt", list(NP))
def test_a_bank_takes_the_edge_with_the_python_paths_bits(monkeypatch, odt):
    rng = np.random.default_rng(10)
    bank = lora.LoraBank(_deltas(rng) + [None])
    x = rng.standard_normal((6, COLS)).astype(np.float32)
    out0 = rng.standard_normal((6, ROWS)).astype(NP[odt])
    ids = np.array([0, 2, -1, 1, 3, 0], np.int64)
    pos = rng.uniform(0.25, 2.0, 6)
    for i, p in [(ids, None), (ids, pos)]:
        o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_batch_to(x, o, i, p), out0.copy)
        assert seen == [0]
        assert_same_bits(o1, o2)


def test_ids_per_sequence_take_the_edge(monkeypatch):
    """ids of shape [batch] for a [batch, seq, hidden] input: one adapter per sequence."""
    rng = np.random.default_rng(11)
    bank = lora.LoraBank(_deltas(rng))
    x = rng.standard_normal((2, 3, COLS)).astype(np.float32)
    ids, pos = np.array([2, 0], np.int64), np.array([0.5, 1.5])
    o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_batch_to(x, o, ids, pos),
                              lambda: np.zeros((2, 3, ROWS), np.float32))
    assert seen == [0]
    assert_same_bits(o1, o2)


def test_stacks_and_adapter_set_banks_take_the_edge(monkeypatch):
    rng = np.random.default_rng(12)
    ds = _deltas(rng)
    stack = lora.LoraStack(ds)
    x = rng.standard_normal((4, COLS)).astype(np.float32)
    o1, o2, seen = _both_ways(monkeypatch, lambda o: stack.add_batch_to(x, o),
                              lambda: np.zeros((4, ROWS), np.float32))
    assert seen == [0]
    assert_same_bits(o1, o2)
    o1, o2, seen = _both_ways(monkeypatch, lambda o: stack.add_to(x[0], o),
                              lambda: np.zeros(ROWS, np.float32))
    assert seen == [0]
    assert_same_bits(o1, o2)
    aset = lora.AdapterSet({f"a{i}": lora.LoraAdapter({"proj": d}, name=f"a{i}",
                                                      alpha=2.0 * RANK, scale=d.scale)
                            for i, d in enumerate(ds)})
    sb = aset.bank("proj")
    ids = aset.slots(["a1", "a0", "a2", "a1"])
    o1, o2, seen = _both_ways(monkeypatch, lambda o: sb.add_batch_to(x, o, ids),
                              lambda: np.zeros((4, ROWS), np.float32))
    assert seen == [0]
    assert_same_bits(o1, o2)


def test_a_scale_set_between_calls_is_seen(monkeypatch):
    rng = np.random.default_rng(13)
    ds = _deltas(rng, 2)
    bank = lora.LoraBank(ds)
    x = rng.standard_normal((2, COLS)).astype(np.float32)
    ids = np.array([0, 1], np.int64)
    first = np.zeros((2, ROWS), np.float32)
    bank.add_batch_to(x, first, ids)
    ds[1].scale.set(0.0)
    o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_batch_to(x, o, ids),
                              lambda: np.zeros((2, ROWS), np.float32))
    assert seen == [0]
    assert_same_bits(o1, o2)
    assert_same_bits(o1[0], first[0])
    assert not o1[1].any()


def test_tables_decline_what_the_edge_does_not_take(monkeypatch):
    rng = np.random.default_rng(14)
    bank = lora.LoraBank(_deltas(rng))
    x = rng.standard_normal((3, COLS)).astype(np.float32)
    cases = [np.array([0, 1, 2], np.int32),           # ids not int64: converted by Python
             [0, 1, 2],                                # a list
             np.array([0, 1, 2], np.int64)[::-1]]      # strided
    for ids in cases:
        o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_batch_to(x, o, ids),
                                  lambda: np.zeros((3, ROWS), np.float32))
        assert seen == [DECLINE]
        assert_same_bits(o1, o2)
    ids = np.array([0, 1, 2], np.int64)
    f32_scales = np.array([1, 2, 3], np.float32)  # not float64: converted by Python
    o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_batch_to(x, o, ids, f32_scales),
                              lambda: np.zeros((3, ROWS), np.float32))
    assert seen == [DECLINE]
    assert_same_bits(o1, o2)


def test_a_c_refusal_through_a_table_raises_the_python_paths_error():
    rng = np.random.default_rng(15)
    bank = lora.LoraBank(_deltas(rng))
    x = rng.standard_normal((3, COLS)).astype(np.float32)
    out = np.zeros((3, ROWS), np.float32)
    with pytest.raises(IndexError, match="position 1"):
        bank.add_batch_to(x, out, np.array([0, 7, 1], np.int64))
    with pytest.raises(ValueError, match="finite"):
        bank.add_batch_to(x, out, np.array([0, 1, 1], np.int64), np.array([1.0, np.inf, 1.0]))
    assert not out.any()


def _dora(rng):
    a = rng.standard_normal((RANK, COLS)).astype(np.float32)
    b = rng.standard_normal((ROWS, RANK)).astype(np.float32)
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    return lora.DoraDelta(a, b, np.abs(rng.standard_normal(ROWS)).astype(np.float32) + 1.0, w,
                          alpha=2.0 * RANK)


def test_dora_tables_take_the_edge(monkeypatch):
    """A member with an epilogue (DoRA's row factor) is one more table member to the edge: a
    bank of DoRA and plain entries takes it, and per-position scales take the checked path,
    which makes each position's row factors; both give the checked path's bits."""
    rng = np.random.default_rng(16)
    bank = lora.LoraBank([_dora(rng)] + _deltas(rng, 2))
    x = rng.standard_normal((5, COLS)).astype(np.float32)
    ids = np.array([0, 2, 0, -1, 1], np.int64)
    o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_batch_to(x, o, ids),
                              lambda: np.ones((5, ROWS), np.float32))
    assert seen == [0]
    assert_same_bits(o1, o2)
    pos = np.array([0.5, 1.0, 2.0, 1.0, 0.0])
    o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_batch_to(x, o, ids, pos),
                              lambda: np.ones((5, ROWS), np.float32))
    assert seen == [DECLINE]
    assert_same_bits(o1, o2)


def test_a_dora_stack_decode_takes_the_edge(monkeypatch):
    """A stack holding a DoRA member decodes in C, with the checked path's bits."""
    stack = lora.LoraStack([_dora(np.random.default_rng(19))])
    x = np.ones(COLS, np.float32)
    o1, o2, seen = _both_ways(monkeypatch, lambda o: stack.add_to(x, o),
                              lambda: np.ones(ROWS, np.float32))
    assert seen == [0]
    assert_same_bits(o1, o2)


def test_a_tensor_bank_takes_the_edge(monkeypatch):
    torch = _torch()
    rng = np.random.default_rng(17)
    bank = lora.LoraBank(_deltas(rng))
    x = torch.from_numpy(rng.standard_normal((3, COLS)).astype(np.float32))
    ids = np.array([2, 0, 1], np.int64)
    bank.add_batch_to(x, torch.zeros(3, ROWS), ids)  # sets torch up
    o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_batch_to(x, o, ids),
                              lambda: torch.zeros(3, ROWS))
    assert seen == [0]
    assert_same_bits(o1.numpy(), o2.numpy())


def test_a_table_call_without_positions_still_checks_its_scales():
    rng = np.random.default_rng(18)
    bank = lora.LoraBank(_deltas(rng, 1))
    with pytest.raises(ValueError, match="non-finite"):
        bank.add_batch_to(np.zeros((2, 0, COLS), np.float32), np.zeros((2, 0, ROWS), np.float32),
                          np.zeros(2, np.int64), np.array([np.nan, 1.0]))


# ---------------------------------------------------------------- embedding gathers

def _rows_ref(d, ids, out):
    """The gather through cffi on copies: one lora_call of a table of one entry."""
    ids, out = np.ascontiguousarray(ids, np.int64).copy(), out.copy()
    c = ffi.new("lora_call *")
    first = ffi.new("int64_t[2]", [0, 1])
    ptrs = ffi.new("lora_delta *[1]", [d._ptr])
    sc = ffi.new("double[1]", [float(np.float32(d._scale._value * d._alpha_factor))])
    c.op, c.n_entries, c.first, c.deltas, c.scales = lib.LORA_OP_ROWS, 1, first, ptrs, sc
    c.rows, c.cols, c.n, c.ids = ROWS, COLS, ids.size, ffi.from_buffer("int64_t[]", ids)
    c.out, c.out_dtype, c.ldo = ffi.from_buffer(out, require_writable=True), CODE[out.dtype.name], COLS
    assert lib.lora_apply(c) == 0
    return out


@pytest.mark.parametrize("odt", list(NP))
@pytest.mark.parametrize("shape", [(), (1,), (5,), (2, 3)])
def test_gathers_take_the_edge_with_the_cffi_bits(d, monkeypatch, odt, shape):
    """add_row_to (an int) and add_rows_to (int64 ids of any shape) are one C call that reads
    the id(s) and out itself: no Python-side checks, the bits of the cffi call."""
    rng = np.random.default_rng(11)
    ids = rng.integers(0, ROWS, size=shape if shape else (1,))
    ids.reshape(-1)[0] = ROWS - 1  # the last row
    out = rng.standard_normal(shape + (COLS,)).astype(NP[odt])
    ref = _rows_ref(d, ids, out)

    def call(o):
        return d.add_rows_to(ids, o) if shape else d.add_row_to(int(ids[0]), o)
    call(out.copy())  # bfloat16 joins the fast dtypes at its first array
    seen = _counting(monkeypatch)
    assert call(out) is out
    assert seen == [0]
    assert_same_bits(out, ref)


def test_gathers_the_edge_declines_keep_the_checked_paths_rules(d, monkeypatch):
    """Anything but the common case (a numpy integer or bool id, ids of another dtype or
    layout, a strided out, a shape that does not fit) is declined to the checked path, and an id
    out of range comes back as C's refusal: the same results, the same errors, nothing written
    on error."""
    rng = np.random.default_rng(12)
    out = rng.standard_normal(COLS).astype(np.float32)
    ref = _rows_ref(d, [4], out[None])[0]
    seen = _counting(monkeypatch)
    for r in (np.int64(4), np.int32(4)):
        o = out.copy()
        d.add_row_to(r, o)
        assert_same_bits(o, ref)
    ids = np.array([4, 0, 4], np.int64)
    outs = np.repeat(out[None], 3, axis=0)
    want = _rows_ref(d, ids, outs)
    for i in (ids.astype(np.int32), np.repeat(ids, 2)[::2], list(ids)):
        o = outs.copy()
        d.add_rows_to(i, o)
        assert_same_bits(o, want)
    assert seen == [DECLINE] * 5
    o = out.copy()
    errors = [(lambda: d.add_row_to(True, o), TypeError), (lambda: d.add_row_to(ROWS, o), IndexError),
              (lambda: d.add_row_to(-1, o), IndexError), (lambda: d.add_row_to(2**70, o), IndexError),
              (lambda: d.add_row_to(1, np.zeros(COLS + 1, np.float32)), ValueError),
              (lambda: d.add_rows_to(np.array([1, ROWS], np.int64), np.zeros((2, COLS), np.float32)),
               IndexError),
              (lambda: d.add_rows_to(np.array(3, np.int64), o), ValueError),
              (lambda: d.add_rows_to(ids, np.zeros((2, COLS), np.float32)), ValueError),
              (lambda: d.add_rows_to(ids, np.repeat(outs, 2, axis=1)[:, ::2]), ValueError)]
    for call, err in errors:
        with pytest.raises(err):
            call()
    assert_same_bits(o, out)
    with pytest.raises(IndexError, match=f"token id {ROWS} at position 1 "):
        d.add_rows_to(np.array([1, ROWS], np.int64), np.zeros((2, COLS), np.float32))
    assert _edge_call(d, _apply.OP_ROW, ROWS, out.copy(), 1.0) == (lib.LORA_ERR_INDEX, 0)
    assert _edge_call(d, _apply.OP_ROWS, np.array([0, ROWS]), np.zeros((2, COLS), np.float32),
                      1.0) == (lib.LORA_ERR_INDEX, 1)


def test_gathers_bad_scale_comes_back_as_a_c_status(d):
    out = np.zeros(COLS, np.float32)
    assert _edge_call(d, _apply.OP_ROW, 1, out, 1e300) == (lib.LORA_ERR_SCALE, -1)
    assert not out.any()


def test_gathers_into_tensors_take_the_edge(d, monkeypatch):
    torch = _torch()
    rng = np.random.default_rng(13)
    ids = np.array([3, ROWS - 1], np.int64)
    out = rng.standard_normal((2, COLS)).astype(np.float32)
    ref = _rows_ref(d, ids, out)
    d.add_row_to(0, torch.zeros(COLS))  # torch joins the edge at the first tensor
    seen = _counting(monkeypatch)
    t = torch.from_numpy(out.copy())
    assert d.add_rows_to(ids, t) is t
    row = torch.from_numpy(out[1].copy())
    d.add_row_to(ROWS - 1, row)
    assert seen == [0, 0]
    assert_same_bits(t.numpy(), ref)
    assert_same_bits(row.numpy(), ref[1])
    leaf = torch.zeros(COLS, requires_grad=True)  # declined: the checked path refuses it
    with pytest.raises(ValueError, match="requires grad"):
        d.add_row_to(0, leaf)
    assert seen[-1] == DECLINE


def test_a_bank_gather_takes_the_edge(monkeypatch):
    """A bank's gather (token ids and adapter ids) is one C call too."""
    rng = np.random.default_rng(14)
    bank = lora.LoraBank(_deltas(rng) + [None])
    tok = np.array([[0, 5], [ROWS - 1, 2]], np.int64)
    ids = np.array([[1, 3], [0, 2]], np.int64)
    o1, o2, seen = _both_ways(monkeypatch, lambda o: bank.add_rows_to(tok, o, ids),
                              lambda: np.ones((2, 2, COLS), np.float32))
    assert seen == [0]
    assert_same_bits(o1, o2)


def test_dtype_objects_equal_to_the_kernels_dtypes_are_read_through_canonical_views(d):
    """NumPy dtypes equal to float32 / int64 / float64 but not NumPy's own objects (a dtype
    with metadata) are declined by the edge, which compares dtype objects, and then read by the
    checked path through views with NumPy's own objects: the same results, out written in
    place."""
    rng = np.random.default_rng(23)
    f32 = np.dtype(np.float32, metadata={"m": 1})
    i64 = np.dtype(np.int64, metadata={"m": 1})
    f64 = np.dtype(np.float64, metadata={"m": 1})
    assert f32 is not np.dtype(np.float32) and f32 == np.float32
    x, out = _arrays(rng, (3,), "float32", "float32")
    ref = _cffi_ref(d, x, out)
    o = out.astype(f32)
    assert d.add_batch_to(x.astype(f32), o) is o
    assert_same_bits(o.view(np.float32), ref)
    bank = lora.LoraBank([d, None])
    o = out.astype(f32)
    bank.add_batch_to(x.astype(f32), o, np.array([0, 1, 0]).astype(i64),
                      np.array([1.0, 1.0, 1.0]).astype(f64))
    want = ref.copy()
    want[1] = out[1]
    assert_same_bits(o.view(np.float32), want)
    tok = np.array([1, ROWS - 1]).astype(i64)
    g = np.zeros((2, COLS), f32)
    d.add_rows_to(tok, g)
    assert_same_bits(g.view(np.float32), _rows_ref(d, [1, ROWS - 1], np.zeros((2, COLS), np.float32)))


def test_subclasses_are_written_in_place_through_plain_aliases(d, tmp_path):
    """An out that is a NumPy subclass (np.memmap) or a torch subclass (an nn.Parameter that
    does not require grad), declined by the edge, which takes the exact types, is written in
    place by the checked path through a plain alias of the same memory."""
    rng = np.random.default_rng(24)
    x, out = _arrays(rng, (2,), "float32", "float32")
    ref = _cffi_ref(d, x, out)
    mm = np.memmap(tmp_path / "out.bin", dtype=np.float32, mode="w+", shape=out.shape)
    mm[:] = out
    assert d.add_batch_to(x, mm) is mm
    assert_same_bits(np.asarray(mm), ref)
    torch = _torch()
    p = torch.nn.Parameter(torch.from_numpy(out.copy()), requires_grad=False)
    assert d.add_batch_to(torch.from_numpy(x), p) is p
    assert_same_bits(p.detach().numpy(), ref)
    px = torch.nn.Parameter(torch.from_numpy(x.copy()), requires_grad=False)
    o = out.copy()
    d.add_batch_to(px, o)
    assert_same_bits(o, ref)
