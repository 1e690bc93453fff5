"""LoraExperts (routed experts): every routing form against a float64 reference, every slot's
bits equal to its expert applied alone (whatever the routing, batch, ISA and thread count),
-1 slots and empty batches untouched, every x / out / storage dtype, torch tensors and
row-strided views, errors raised before anything is written, banks and AdapterSet MoE banks
(rows equal their entry alone, hot swap), merges into 3-D expert weights, pickling and
copies."""

import copy
import pickle

import numpy as np
import pytest

import lora
from lora._lora_cffi import ffi, lib
from conftest import (DTYPES, assert_accurate, assert_same_bits, can_run_two_threads,
                      num_threads, rand)

TWO = can_run_two_threads()


def make_experts(rng, n, rank, rows, cols, dtype="float32", **kw):
    a = rng.standard_normal((n, rank, cols))
    b = rng.standard_normal((n, rows, rank))
    return lora.LoraExperts(a, b, dtype=dtype, **kw)


def reference(ex, x, ids, out):
    """(float64 ref, NumPy float32) of out[..., j, :] += s B_e (A_e x_j), both routing forms."""
    a, b = (f.astype(np.float64) for f in ex.lora_weights())
    s = ex.effective_scale
    ids = np.asarray(ids)
    flat = ids.reshape(-1)
    k = ids.shape[-1] if ids.ndim else 1
    shared = x.ndim == ids.ndim
    xr = x.reshape(-1, ex.cols)
    ref = out.astype(np.float64).reshape(-1, ex.rows).copy()
    np32 = out.astype(np.float32).reshape(-1, ex.rows).copy()
    s32 = np.float32(s)
    for q, e in enumerate(flat):
        if e < 0:
            continue
        xq = xr[q // k if shared else q]
        ref[q] += s * b[e] @ (a[e] @ xq.astype(np.float64))
        np32[q] += s32 * (b[e].astype(np.float32) @ (a[e].astype(np.float32)
                                                     @ xq.astype(np.float32)))
    return ref.reshape(out.shape), np32.reshape(out.shape)


def alone(ex, x, ids, out0):
    """Each slot through expert(e).add_to on its own row: the bits every routed call must give."""
    ids = np.asarray(ids)
    k = ids.shape[-1]
    shared = x.ndim == ids.ndim
    xr = x.reshape(-1, ex.cols)
    want = out0.copy().reshape(-1, ex.rows)
    for q, e in enumerate(ids.reshape(-1)):
        if e >= 0:
            row = want[q].copy()
            ex.expert(int(e)).add_to(xr[q // k if shared else q], row)
            want[q] = row
    return want.reshape(out0.shape)


# ------------------------------------------------------------------ routing forms


FORMS = {
    # name: (ids shape, shared x?)
    "token [T,k] x [T,cols]": ((5, 3), True),
    "slot [T,k] x [T,k,cols]": ((5, 3), False),
    "flat [S] x [S,cols]": ((11,), False),
    "one token [k] x [cols]": ((8,), True),
    "batch-seq [B,T,k] x [B,T,cols]": ((2, 3, 2), True),
}


@pytest.mark.parametrize("form", FORMS)
def test_routing_forms_match_reference_and_the_expert_alone(isa, dtype, form):
    rng = np.random.default_rng(7)
    n, rank, rows, cols = 6, 7, 33, 17
    ex = make_experts(rng, n, rank, rows, cols, dtype, alpha=14.0)
    ishape, shared = FORMS[form]
    ids = rng.integers(-1, n, size=ishape)
    ids.reshape(-1)[:2] = [n - 1, -1]
    x = rand(rng, ishape[:-1] + (cols,) if shared else ishape + (cols,))
    out0 = rand(rng, ishape + (rows,))
    out = ex.add_to(x, out0.copy(), ids)
    ref, np32 = reference(ex, x, ids, out0)
    assert_accurate(out, ref, np32, form)
    assert_same_bits(out, alone(ex, x, ids, out0), form)
    untouched = np.asarray(ids) < 0
    assert_same_bits(out[untouched], out0[untouched], "-1 slots")


@pytest.mark.parametrize("k", range(1, 9))
def test_k_1_to_8_with_repeated_experts(isa, k):
    rng = np.random.default_rng(k)
    n, rows, cols = 5, 31, 16
    ex = make_experts(rng, n, 15, rows, cols, alpha=30.0)
    ids = rng.integers(-1, n, size=(9, k))
    ids[0] = 2                        # one expert in every slot of a token
    if k > 1:
        ids[1, :2] = [4, 4]
    x = rand(rng, (9, cols))
    for xs in (x, np.repeat(x[:, None, :], k, axis=1) + rand(rng, (9, k, cols))):
        out0 = rand(rng, (9, k, rows))
        out = ex.add_to(xs, out0.copy(), ids)
        ref, np32 = reference(ex, xs, ids, out0)
        assert_accurate(out, ref, np32, f"k={k}")
        assert_same_bits(out, alone(ex, xs, ids, out0), f"k={k}")


def test_sizes_straddling_register_widths(isa):
    rng = np.random.default_rng(3)
    for rows, cols, rank in ((1, 1, 1), (7, 15, 16), (16, 17, 31), (33, 32, 33), (129, 65, 17)):
        ex = make_experts(rng, 3, rank, rows, cols)
        ids = rng.integers(-1, 3, size=(6, 2))
        x = rand(rng, (6, cols))
        out0 = rand(rng, (6, 2, rows))
        out = ex.add_to(x, out0.copy(), ids)
        assert_accurate(out, *reference(ex, x, ids, out0), f"{rows}x{cols} r{rank}")
        assert_same_bits(out, alone(ex, x, ids, out0))


@pytest.mark.parametrize("xt", DTYPES)
@pytest.mark.parametrize("ot", DTYPES)
def test_every_activation_dtype(isa, dtype, xt, ot):
    """x of any dtype read in place; a half out equals the float32 out rounded once."""
    rng = np.random.default_rng(11)
    ex = make_experts(rng, 4, 9, 40, 24, dtype, alpha=18.0)
    ids = rng.integers(-1, 4, size=(7, 3))
    x = rand(rng, (7, 24)).astype(lora._dtypes.np_dtype(xt))
    out0 = rand(rng, (7, 3, 40)).astype(lora._dtypes.np_dtype(ot))
    out = ex.add_to(x, out0.copy(), ids)
    wide = ex.add_to(x, out0.astype(np.float32), ids)
    assert_same_bits(out, wide.astype(out.dtype), f"{xt} -> {ot}")
    assert_same_bits(out, alone(ex, x, ids, out0), f"{xt} -> {ot}")


def test_a_different_summation_order_would_show():
    """Each slot equals its expert's add_batch_to on the rows it serves, in any routing and any
    pair order: the batched kernels' bits are pinned (golden bits), so an experts path that
    summed in another order, or in another grouping, would differ here."""
    rng = np.random.default_rng(5)
    n, rows, cols = 8, 96, 200
    for dtype in DTYPES:
        ex = make_experts(rng, n, 16, rows, cols, dtype, alpha=8.0)
        x = rand(rng, (64, cols))
        ids = rng.integers(0, n, size=64)
        out = ex.add_to(x, np.zeros((64, rows), np.float32), ids)
        order = np.argsort(ids, kind="stable")           # transformers' grouped_mm order
        sorted_out = ex.add_to(x[order], np.zeros((64, rows), np.float32), ids[order])
        assert_same_bits(sorted_out, out[order], "expert-sorted pairs")
        for e in range(n):
            rows_e = np.flatnonzero(ids == e)
            want = ex.expert(e).add_batch_to(x[rows_e], np.zeros((rows_e.size, rows), np.float32))
            assert_same_bits(out[rows_e], want, f"{dtype} expert {e}")


@pytest.mark.skipif(not TWO, reason="needs two threads")
def test_thread_count_invariance(isa):
    """1 thread and a team of 2 (asserted: the adaptive policy reset, a team call counted) give
    the same bits: a decode's 8 experts, a small and a large prefill."""
    rng = np.random.default_rng(9)
    ex = make_experts(rng, 16, 16, 1536, 1024, alpha=16.0)
    calls = ffi.new("int64_t *"), ffi.new("int64_t *")
    for t, k in ((1, 8), (48, 8), (300, 2)):
        ids = rng.integers(0, 16, size=(t, k))
        ids[0, 0] = -1
        x = rand(rng, (t, 1024))
        out0 = rand(rng, (t, k, 1536))
        with num_threads(1):
            one = ex.add_to(x, out0.copy(), ids)
        with num_threads(2):
            lib.lora_team_reset()
            two = ex.add_to(x, out0.copy(), ids)
            lib.lora_team_stats(*calls)
            lib.lora_team_reset()
        assert calls[0][0] >= 1, f"T={t} k={k}: no team call"
        assert_same_bits(one, two, f"T={t} k={k}")


def test_empty_batches_and_scale_zero_touch_nothing():
    rng = np.random.default_rng(1)
    ex = make_experts(rng, 4, 3, 8, 6)
    for ishape in ((0, 2), (3, 0), (0,)):
        ids = np.zeros(ishape, np.int64)
        out0 = rand(rng, ishape + (8,))
        assert_same_bits(ex.add_to(rand(rng, ishape[:-1] + (6,)), out0.copy(), ids), out0)
        assert_same_bits(ex.add_to(rand(rng, ishape + (6,)), out0.copy(), ids), out0)
    ids = rng.integers(0, 4, size=(5, 2))
    out0 = rand(rng, (5, 2, 8))
    ex.scale.set(0.0)
    assert_same_bits(ex.add_to(rand(rng, (5, 6)), out0.copy(), ids), out0, "scale 0")
    with pytest.raises(IndexError):  # validation still runs at scale 0
        ex.add_to(rand(rng, (5, 6)), out0.copy(), np.full((5, 2), 4))


# ------------------------------------------------------------------ torch, views


def test_torch_tensors_and_row_strided_out(isa):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    ex = make_experts(rng, 6, 8, 24, 20, alpha=4.0)
    ids = rng.integers(-1, 6, size=(7, 2))
    x = rand(rng, (7, 20))
    want = ex.add_to(x, np.zeros((7, 2, 24), np.float32), ids)
    for xt in (torch.float32, torch.bfloat16):
        for ot in (torch.float32, torch.bfloat16, torch.float16):
            tx = torch.from_numpy(x).to(xt)
            out = torch.zeros(7, 2, 24, dtype=ot)
            got = ex.add_to(tx, out, torch.from_numpy(ids))
            assert got is out
            ref = ex.add_to(tx.float().numpy(), np.zeros((7, 2, 24), np.float32), ids)
            assert_same_bits(out.float().numpy(), torch.from_numpy(ref).to(ot).float().numpy())
    # out a row-strided view of a wider buffer (the gate half of a fused output), ids as int32
    big = torch.zeros(7, 2, 40)
    ex.add_to(torch.from_numpy(x), big[:, :, :24], torch.from_numpy(ids.astype(np.int32)))
    assert_same_bits(big[:, :, :24].numpy(), want)
    assert not big[:, :, 24:].any()
    npbig = np.zeros((7, 2, 30), np.float32)
    ex.add_to(x, npbig[..., 3:27], ids)
    assert_same_bits(npbig[..., 3:27], want)
    with pytest.raises(ValueError, match="requires grad"):
        ex.add_to(torch.from_numpy(x), torch.zeros(7, 2, 24, requires_grad=True), ids)
    with pytest.raises(TypeError, match="device"):
        ex.add_to(torch.from_numpy(x), torch.zeros(7, 2, 24, device="meta"), ids)


# ------------------------------------------------------------------ bad input


def test_bad_input_is_refused_before_anything_is_written():
    rng = np.random.default_rng(4)
    n = 5
    ex = make_experts(rng, n, 4, 12, 10)
    x = rand(rng, (6, 10))
    ids = rng.integers(0, n, size=(6, 2))
    out0 = rand(rng, (6, 2, 12))

    def refused(exc, match, xin, ids_in):
        out = out0.copy()
        with pytest.raises(exc, match=match):
            ex.add_to(xin, out, ids_in)
        assert_same_bits(out, out0, match)

    for bad in (n, -2, 1000):                    # n: the expert-parallel sentinel
        b = ids.copy()
        b[4, 1] = bad                            # after valid ids: still nothing written
        refused(IndexError, rf"expert id {bad} at position \(4, 1\)", x, b)
    b = ids.astype(np.uint64)
    b[4, 1] = 2**64 - 1                          # past int64: the same wording, range included
    refused(IndexError, rf"expert id {2**64 - 1} at position \(4, 1\) is out of range: valid "
                        rf"ids are -1 \(no expert\) and 0\.\.{n - 1}$", x, b)
    refused(ValueError, r"out must have shape \(6, 3, 12\)", x, rng.integers(0, n, (6, 3)))
    refused(ValueError, r"x has shape \(5, 10\)", x[:5], ids)
    refused(ValueError, r"x has shape \(6, 2, 9\)", rand(rng, (6, 2, 9)), ids)
    refused(ValueError, r"x has shape", rand(rng, (6, 2, 2, 10)), ids)
    refused(TypeError, "integers", x, ids.astype(np.float64))
    refused(TypeError, "integers", x, ids.astype(bool))
    with pytest.raises(ValueError, match="at least one axis"):
        ex.add_to(x[0], out0[0, 0].copy(), np.int64(2))
    with pytest.raises(ValueError, match="overlap"):
        buf = np.zeros((6, 2, 12), np.float32)
        ex.add_to(buf[:, 0, :10], buf, ids)
    ro = out0.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ex.add_to(x, ro, ids)
    with pytest.raises(TypeError):
        ex.add_to(x, out0.astype(np.float64), ids)


def test_fast_paths_refuse_as_the_checked_path_does():
    """ndarray and tensor calls of the fast forms (int64 ids, contiguous x / out, adapter ids
    as arrays or tensors): a bad id is the same IndexError, with nothing written."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(17)
    ex = make_experts(rng, 4, 3, 10, 8)
    bank = lora.LoraBank([ex, None, ex])
    x, out0 = rand(rng, (5, 8)), rand(rng, (5, 2, 10))
    ids = rng.integers(0, 4, size=(5, 2))
    bad = ids.copy()
    bad[3, 1] = 4
    aid = np.array([0, 1, 2, -1, 0])
    for conv in (np.asarray, torch.from_numpy):
        for call in (lambda o, e: ex.add_to(conv(x), o, conv(e)),
                     lambda o, e: bank.add_experts_to(conv(x), o, conv(aid), conv(e))):
            out = conv(out0.copy())
            with pytest.raises(IndexError, match=r"expert id 4 at position \(3, 1\)"):
                call(out, bad)
            assert_same_bits(np.asarray(out), out0)
            call(out, ids)
            assert not np.array_equal(np.asarray(out), out0)
        out = conv(out0.copy())
        with pytest.raises(IndexError, match="adapter id 3 at position 4"):
            bank.add_experts_to(conv(x), out, conv(np.array([0, 1, 2, -1, 3])), conv(ids))
        assert_same_bits(np.asarray(out), out0)


def test_experts_over_views_of_the_callers_memory(isa):
    """Experts made of `LoraDelta.view`s (how accelerate_peft reads PEFT's lora_A in place and
    its repacked lora_B): the same bits as owned experts of the same values; a pickle owns a
    copy."""
    rng = np.random.default_rng(18)
    n, r, rows, cols = 5, 4, 24, 16
    a = rand(rng, (n * r, cols))                       # PEFT's lora_A [r*E, in]
    bt = rand(rng, (n, r, rows))                       # expert e's B^T rows, [E, r, out]
    scale = lora.LoraScale(0.5)
    isz = 4
    views = [lora.LoraDelta.view((a.ctypes.data + e * r * cols * isz, cols),
                                 (bt.ctypes.data + e * r * rows * isz, rows), dtype="float32",
                                 rank=r, rows=rows, cols=cols, scale=scale, keep=(a, bt))
             for e in range(n)]
    ex = lora.LoraExperts._from_deltas(views)
    owned = lora.LoraExperts(a.reshape(n, r, cols), bt.transpose(0, 2, 1), scale=scale)
    ids = rng.integers(-1, n, size=(6, 2))
    x = rand(rng, (6, cols))
    want = owned.add_to(x, np.zeros((6, 2, rows), np.float32), ids)
    assert_same_bits(ex.add_to(x, np.zeros((6, 2, rows), np.float32), ids), want)
    assert_same_bits(pickle.loads(pickle.dumps(ex)).add_to(x, np.zeros((6, 2, rows),
                                                                        np.float32), ids), want)
    with pytest.raises(ValueError, match="LoraScale"):
        lora.LoraExperts._from_deltas([views[0], lora.LoraDelta(np.ones((r, cols)),
                                                                np.ones((rows, r)))])


def test_constructor_and_properties():
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((4, 3, 10)), rng.standard_normal((4, 12, 3))
    ex = lora.LoraExperts(a, b, alpha=6.0, scale=0.5, dtype="bfloat16")
    assert (ex.n_experts, ex.rank, ex.rows, ex.cols) == (4, 3, 12, 10)
    assert ex.base_shape == (12, 10) and ex.expert_shape == (4, 12, 10)
    assert ex.dtype == "bfloat16" and ex.alpha_factor == 2.0 and ex.effective_scale == 1.0
    assert ex.resident_bytes == 4 * 3 * (12 + 10) * 2
    d = ex.expert(2)
    assert isinstance(d, lora.LoraDelta) and d.scale is ex.scale and d.dtype == "bfloat16"
    np.testing.assert_array_equal(d.lora_weights()[0].astype(np.float64),
                                  a[2].astype(lora._dtypes.np_dtype("bfloat16")))
    assert ex.expert(2) is d                       # the same storage, not a copy
    ex.scale.set(2.0)
    assert d.effective_scale == ex.effective_scale == 4.0
    for bad in (4, -1):
        with pytest.raises(IndexError):
            ex.expert(bad)
    with pytest.raises(TypeError):
        ex.expert(1.0)
    for a2, b2, what in ((a[:3], b, "3 experts in lora_a, 4 in lora_b"),
                         (a, b[:, :, :2], "rank 3 in lora_a, 2 in lora_b"),
                         (a[0], b[0], "3-D")):
        with pytest.raises(lora.LoraShapeError, match=what) as err:
            lora.LoraExperts(a2, b2)
        assert str(a2.shape) in str(err.value) and str(b2.shape) in str(err.value)
    with pytest.raises(ValueError, match="non-finite"):
        lora.LoraExperts(np.full((2, 1, 3), np.inf), np.ones((2, 3, 1)))
    with pytest.raises(ValueError, match="overflows"):
        lora.LoraExperts(np.full((2, 1, 3), 1e6), np.ones((2, 3, 1)), dtype="float16")
    w = ex.delta_weight()
    ref = ex.effective_scale * np.einsum("eor,eri->eoi", *(f.astype(np.float64) for f in
                                                          reversed(ex.lora_weights())))
    np.testing.assert_allclose(w, ref, rtol=1e-6)
    assert w.dtype == np.float32 and w.shape == ex.expert_shape


def test_pickle_and_copies_keep_bits_and_scale_sharing():
    rng = np.random.default_rng(8)
    for dtype in DTYPES:
        shared = lora.LoraScale(0.75)
        ex = make_experts(rng, 3, 4, 9, 7, dtype, alpha=2.0, scale=shared)
        ids = rng.integers(-1, 3, size=(4, 2))
        x = rand(rng, (4, 7))
        want = ex.add_to(x, np.zeros((4, 2, 9), np.float32), ids)
        ex2, scale2 = pickle.loads(pickle.dumps([ex, shared]))
        assert ex2.scale is scale2 and scale2 is not shared and ex2.dtype == dtype
        assert_same_bits(ex2.add_to(x, np.zeros((4, 2, 9), np.float32), ids), want)
        c = copy.copy(ex)
        assert c.scale is shared and c.expert(1) is ex.expert(1)
        assert_same_bits(c.add_to(x, np.zeros((4, 2, 9), np.float32), ids), want)
        d, dscale = copy.deepcopy([ex, shared])
        assert d.scale is dscale and dscale is not shared and d.expert(1) is not ex.expert(1)
        assert_same_bits(d.add_to(x, np.zeros((4, 2, 9), np.float32), ids), want)
    z = make_experts(rng, 2, 2, 3, 3, alpha=0.0)  # PEFT's alpha-0 rule survives a pickle
    z._zero_alpha()
    assert pickle.loads(pickle.dumps(z)).effective_scale == 0.0


# ------------------------------------------------------------------ merges


@pytest.mark.parametrize("wdt", DTYPES)
def test_merge_into_3d_weights_both_layouts(wdt):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    ex = make_experts(rng, 3, 4, 10, 6, alpha=8.0)
    npdt = lora._dtypes.np_dtype(wdt)
    w0 = rand(rng, (3, 10, 6)).astype(npdt)
    ref = (w0.astype(np.float64) + ex.effective_scale * np.einsum(
        "eor,eri->eoi", *(f.astype(np.float64) for f in reversed(ex.lora_weights()))))
    for layout in ("rows", "transposed", "torch", "torch transposed"):
        if layout.endswith("transposed"):
            store = np.ascontiguousarray(w0.transpose(0, 2, 1))
        else:
            store = w0.copy()
        if layout.startswith("torch"):
            t = torch.from_numpy(store.view(np.uint16) if wdt == "bfloat16" else store)
            t = t.view(torch.bfloat16) if wdt == "bfloat16" else t
            p = torch.nn.Parameter(t, requires_grad=True)
            w = p.transpose(-1, -2) if layout.endswith("transposed") else p
            ex.merge_into(w)
            got = p.detach().float().numpy()
        else:
            w = store.transpose(0, 2, 1) if layout.endswith("transposed") else store
            ex.merge_into(w)
            got = store.astype(np.float32)
        if layout.endswith("transposed"):
            got = got.transpose(0, 2, 1)
        want = ref.astype(npdt) if wdt != "bfloat16" else lora._dtypes.round_to(ref, wdt)
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=layout)
    back = w0.copy()
    ex.merge_into(back)
    ex.unmerge_from(back)
    np.testing.assert_allclose(back.astype(np.float32), w0.astype(np.float32),
                               atol=float(np.finfo(npdt).eps) * 8 if wdt != "bfloat16" else 0.1)


def test_merge_refusals_write_nothing():
    rng = np.random.default_rng(12)
    ex = make_experts(rng, 3, 2, 5, 4)
    w = rand(rng, (3, 5, 4)).astype(np.float16)
    w[2, 1, 1] = 65000.0                          # the last expert overflows float16
    ex.scale.set(1e4)
    before = w.copy()
    with pytest.raises(ValueError, match="expert 2: .*overflows"):
        ex.merge_into(w)
    assert_same_bits(w, before)                   # experts 0 and 1 were not written either
    ex.scale.set(0.0)
    ex.merge_into(w)
    assert_same_bits(w, before, "scale 0")
    with pytest.raises(ValueError, match=r"w.transpose\(-1, -2\)"):
        ex.merge_into(np.zeros((3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        ex.merge_into(np.zeros((3, 10, 4), np.float32)[:, ::2])
    with pytest.raises(TypeError):
        ex.merge_into([[0.0]])


# ------------------------------------------------------------------ banks


def test_bank_rows_equal_their_entry_alone(isa):
    rng = np.random.default_rng(13)
    n, rows, cols = 6, 20, 18
    e1 = make_experts(rng, n, 4, rows, cols, "float32")                # alpha 0: factor 1
    e2 = make_experts(rng, n, 7, rows, cols, "bfloat16", scale=-0.5)
    e3 = make_experts(rng, n, 2, rows, cols, "float16")
    entries = [e1, None, e2, e3]
    bank = lora.LoraBank(entries)
    assert bank.expert_shape == (n, rows, cols) and bank.base_shape == (rows, cols)
    T, k = 9, 3
    ids = rng.integers(-1, n, size=(T, k))
    x = rand(rng, (T, cols))
    xs = rand(rng, (T, k, cols))
    out0 = rand(rng, (T, k, rows))
    per_token = rng.integers(-1, 4, size=T)
    per_slot = rng.integers(-1, 4, size=(T, k))
    scales = rng.uniform(-2, 2, size=T)
    scales[0] = 0.0
    for xin, aid, sc in ((x, per_token, None), (x, per_slot, None), (xs, per_token, scales),
                         (xs, per_slot, scales[:, None].repeat(k, 1))):
        got = bank.add_experts_to(xin, out0.copy(), aid, ids, sc)
        for t in range(T):
            for j in range(k):
                a = aid[t] if aid.ndim == 1 else aid[t, j]
                row = out0[t, j].copy()
                entry = entries[a] if a >= 0 else None
                s = 1.0 if sc is None else (sc[t] if sc.ndim == 1 else sc[t, j])
                if entry is not None and ids[t, j] >= 0 and s != 0:
                    d = entry.expert(int(ids[t, j]))
                    old = d.scale.value
                    d.scale.set(old * s)
                    d.add_to(xin[t] if xin.ndim == 2 else xin[t, j], row)
                    d.scale.set(old)
                assert_same_bits(got[t, j], row, f"slot ({t}, {j})")
    # flattened, expert-sorted slots with per-slot adapters; a [batch, seq, k] routing with
    # one adapter per sequence
    flat_ids, flat_aid = ids.reshape(-1), per_slot.reshape(-1)
    got = bank.add_experts_to(xs.reshape(-1, cols), out0.reshape(-1, rows).copy(), flat_aid,
                              flat_ids)
    want = bank.add_experts_to(xs, out0.copy(), per_slot, ids)
    assert_same_bits(got, want.reshape(-1, rows))
    x3 = rand(rng, (3, 3, cols))
    got = bank.add_experts_to(x3, out0.reshape(3, 3, k, rows).copy(), np.array([0, 2, -1]),
                              ids.reshape(3, 3, k))
    want = bank.add_experts_to(x3.reshape(T, cols), out0.copy(), np.repeat([0, 2, -1], 3), ids)
    assert_same_bits(got.reshape(T, k, rows), want)
    # one token's k slots, one adapter (a 0-d id)
    got = bank.add_experts_to(x[0], out0[0].copy(), np.int64(2), ids[0])
    assert_same_bits(got, bank.add_experts_to(x[:1], out0[:1].copy(), [2], ids[:1])[0])


def test_bank_refusals():
    rng = np.random.default_rng(14)
    ex = make_experts(rng, 4, 2, 8, 6)
    with pytest.raises(lora.LoraShapeError, match="4 experts of"):
        lora.LoraBank([ex, lora.LoraDelta(np.ones((2, 6)), np.ones((8, 2)))])
    with pytest.raises(lora.LoraShapeError, match="5 experts of"):
        lora.LoraBank([ex, make_experts(rng, 5, 2, 8, 6)])
    bank = lora.LoraBank([ex, None])
    ids = rng.integers(0, 4, size=(3, 2))
    out0 = rand(rng, (3, 2, 8))
    out = out0.copy()
    with pytest.raises(TypeError, match="add_experts_to"):
        bank.add_batch_to(rand(rng, (3, 6)), np.zeros((3, 8), np.float32), [0, 0, 0])
    with pytest.raises(IndexError, match="adapter id 2 at position 1"):
        bank.add_experts_to(rand(rng, (3, 6)), out, [0, 2, 0], ids)
    with pytest.raises(IndexError, match=r"expert id 4 at position \(2, 0\)"):
        bad = ids.copy()
        bad[2, 0] = 4
        bank.add_experts_to(rand(rng, (3, 6)), out, [0, 1, 0], bad)
    with pytest.raises(ValueError, match="adapter_ids must have the leading shape"):
        bank.add_experts_to(rand(rng, (3, 6)), out, [0, 0], ids)
    with pytest.raises(ValueError, match="scales"):
        bank.add_experts_to(rand(rng, (3, 6)), out, [0, 0, 0], ids, [1.0, np.inf, 1.0])
    with pytest.raises(TypeError, match="adapter_ids"):
        bank.add_experts_to(rand(rng, (3, 6)), out, None, ids)
    assert_same_bits(out, out0)
    plain = lora.LoraBank([lora.LoraDelta(np.ones((2, 6)), np.ones((8, 2)))])
    with pytest.raises(TypeError, match="LoraExperts"):
        plain.add_experts_to(rand(rng, (3, 6)), out, [0, 0, 0], ids)


def _moe_adapter(rng, name, n=4, scale=1.0, rank=3):
    s = lora.LoraScale(scale)
    return lora.LoraAdapter(
        {"mlp.experts.gate_up_proj": make_experts(rng, n, rank, 16, 8, scale=s),
         "self_attn.q_proj": lora.LoraDelta(rng.standard_normal((2, 8)),
                                            rng.standard_normal((8, 2)), scale=s)},
        name=name, alpha=0.0, scale=s)


def test_adapter_set_moe_bank_and_hot_swap(isa):
    rng = np.random.default_rng(15)
    one, two, three = (_moe_adapter(rng, f"a{i}") for i in range(3))
    aset = lora.AdapterSet({"one": one, "two": two})
    bank = aset.bank("mlp.experts.gate_up_proj")
    assert bank.expert_shape == (4, 16, 8) and bank.base_shape == (16, 8)
    assert aset.bank("self_attn.q_proj").expert_shape is None
    ids = rng.integers(-1, 4, size=(5, 2))
    x = rand(rng, (5, 8))
    aid = np.array([0, 1, -1, 1, 0])

    def alone_rows(adapters):
        out = np.zeros((5, 2, 16), np.float32)
        for t, a in enumerate(aid):
            if a >= 0:
                adapters[a]["mlp.experts.gate_up_proj"].add_to(x[t], out[t], ids[t])
        return out

    got = bank.add_experts_to(x, np.zeros((5, 2, 16), np.float32), aid, ids)
    assert_same_bits(got, alone_rows([one, two]))
    aset.replace("two", three)                  # hot swap: the same slot, the new experts
    got = bank.add_experts_to(x, np.zeros((5, 2, 16), np.float32), aid, ids)
    assert_same_bits(got, alone_rows([one, three]))
    aset.remove("one")
    with pytest.raises(IndexError, match="free slot"):
        bank.add_experts_to(x, np.zeros((5, 2, 16), np.float32), aid, ids)
    with pytest.raises(lora.LoraShapeError, match="5 experts of .* 4 experts of"):
        aset.add("wide", _moe_adapter(rng, "wide", n=5))
    assert aset.names == ["two"]
    with pytest.raises(TypeError, match="MoE target"):
        aset.bank("self_attn.q_proj").add_experts_to(x, np.zeros((5, 2, 8), np.float32),
                                                     aid * 0 + 1, ids)
    # a target no adapter holds: a live bank that adds nothing (ids still checked), and says so
    with pytest.warns(UserWarning, match="no adapter in the set targets"):
        empty = aset.bank("mlp.experts.down_proj")
    out0 = rand(rng, (5, 2, 16))
    assert_same_bits(empty.add_experts_to(x, out0.copy(), aid * 0 + 1, ids), out0)
    with pytest.raises(IndexError):
        empty.add_experts_to(x, out0.copy(), aid * 0 + 1, ids - 5)


def test_adapter_check_base_compares_expert_shape():
    rng = np.random.default_rng(16)
    ad = _moe_adapter(rng, "m")
    ad.check_base({"mlp.experts.gate_up_proj": (4, 16, 8), "self_attn.q_proj": (8, 8)})
    with pytest.raises(lora.LoraShapeError, match=r"\[4 x 16 x 8\].*\[8 x 16 x 8\]"):
        ad.check_base({"mlp.experts.gate_up_proj": np.zeros((8, 16, 8)),
                       "self_attn.q_proj": (8, 8)})
    with pytest.raises(lora.LoraShapeError, match="missing"):
        ad.check_base({"self_attn.q_proj": (8, 8)})
    assert ad.resident_bytes == 4 * 3 * 24 * 4 + 2 * 16 * 4
