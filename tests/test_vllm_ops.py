"""lora.vllm's PunicaWrapper, op by op, driven the way vLLM drives it: vLLM's own `LoRAMapping`
and `update_metadata`, vLLM's stacked slot tensors ``[slots, 1, n, m]``, against a float64
reference.  Every test also checks that the kernels served the call (`lora.vllm.stats`), so a
silent fallback cannot pass for them.  Skipped where vLLM is not installed."""

import warnings

import pytest

pytest.importorskip("vllm", reason="needs a CPU build of vLLM (docs/vllm.md)")
torch = pytest.importorskip("torch")

from vllm.lora.layers import LoRAMapping  # noqa: E402
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402

import lora.vllm as lv  # noqa: E402
import lora._vllm_views as lvv  # noqa: E402

pytestmark = pytest.mark.vllm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}
SLOTS = 3


def wrapper(lora_ids, prompt_ids=None, *, prefill=True, slot_ids=(7, 8, 9)):
    """A PunicaWrapper whose metadata vLLM computed for tokens of LoRA ids ``lora_ids`` (0 = no
    adapter) with slots holding LoRA ids ``slot_ids``."""
    w = lv.PunicaWrapper(256, 16, "cpu")
    prompt_ids = lora_ids if prompt_ids is None else prompt_ids
    w.update_metadata(LoRAMapping(tuple(lora_ids), tuple(prompt_ids), is_prefill=prefill),
                      list(slot_ids), SLOTS, 1000)
    return w


def slot_tensors(shape, dtype, gen, rank=None):
    """vLLM's stacked layout ``[slots, 1, *shape]``; ``rank``: a true rank under the padding
    (vLLM zero-pads each adapter to max_lora_rank): the values past it are zero."""
    t = torch.randn((SLOTS, 1) + tuple(shape), generator=gen).to(dtype)
    return t


def pad_rank(a, b, rank):
    """Zero A's rows and B's columns past ``rank`` (vLLM's padding to max_lora_rank)."""
    a[:, :, rank:] = 0
    b[:, :, :, rank:] = 0


def ref_term(x, a, b, ids, scale):
    """float64 ``scale * (x A^T) B^T`` per row's slot; rows of slot -1 get 0."""
    x64 = x.double()
    out = torch.zeros(x.shape[0], b.shape[-2], dtype=torch.float64)
    for t, s in enumerate(ids.tolist()):
        if s >= 0:
            out[t] = scale * (x64[t] @ a[s, 0].double().T) @ b[s, 0].double().T
    return out


def expand_term(buf, b, ids):
    """float64 ``buf B^T`` per row's slot (vLLM's expand of a float32 rank buffer)."""
    term = torch.zeros(buf.shape[0], b.shape[-2], dtype=torch.float64)
    for t, s in enumerate(ids.tolist()):
        if s >= 0:
            term[t] = buf[t].double() @ b[s, 0].double().T
    return term


def check_close(got, y0, term, dtype):
    """``got`` = ``y0 + term`` within one rounding of ``dtype`` plus float32 compute error."""
    ref = y0.double() + term
    err = (got.double() - ref).abs()
    bound = EPS[dtype] * ref.abs() + 1e-5 * (term.abs().max().item() + 1.0)
    assert bool((err <= bound).all()), f"max error {err.max().item()} (bound {bound.max()})"


def served(before, method):
    return lv.stats().get("kernels:" + method, 0) - before.get("kernels:" + method, 0)


IDS = [7, 0, 9, 7, 0, 8, 8, 0, 9, 7, 0]   # LoRA ids per token: three slots and base tokens


@pytest.mark.parametrize("act", DTYPES)
@pytest.mark.parametrize("lora_dtype", DTYPES)
@pytest.mark.parametrize("prefill", [True, False])
def test_add_lora_linear_packed_slices(act, lora_dtype, prefill):
    gen = torch.Generator().manual_seed(1)
    w = wrapper(IDS, prefill=prefill)
    ids = w.token_lora_indices
    assert (ids == -1).any() and (ids == SLOTS - 1).any()
    T, cols, rmax, outs = len(IDS), 33, 16, (17, 9, 9)       # qkv: three slices
    a = tuple(slot_tensors((rmax, cols), lora_dtype, gen) for _ in outs)
    b = tuple(slot_tensors((n, rmax), lora_dtype, gen) for n in outs)
    pad_rank(a[1], b[1], 5)                                   # a true rank under the padding
    x = torch.randn(T, cols, generator=gen).to(act)
    y = torch.randn(T, sum(outs), generator=gen).to(act)
    y0 = y.clone()
    before = lv.stats()
    w.add_lora_linear(y, x, a, b, 0.75, outs)
    assert served(before, "add_lora_linear") == 3
    off = 0
    for ai, bi, n in zip(a, b, outs):
        check_close(y[:, off:off + n], y0[:, off:off + n], ref_term(x, ai, bi, ids, 0.75), act)
        off += n
    base = ids == -1
    assert torch.equal(y[base].view(torch.int16 if act != torch.float32 else torch.int32),
                       y0[base].view(torch.int16 if act != torch.float32 else torch.int32))


@pytest.mark.parametrize("act", DTYPES)
def test_rows_are_batch_invariant(act):
    """Each row's LoRA term has the bits of the same call with that row alone."""
    gen = torch.Generator().manual_seed(2)
    T, cols, rmax, outs = len(IDS), 64, 16, (48, 16)          # gate_up: two slices
    a = tuple(slot_tensors((rmax, cols), act, gen) for _ in outs)
    b = tuple(slot_tensors((n, rmax), act, gen) for n in outs)
    x = torch.randn(T, cols, generator=gen).to(act)
    y0 = torch.randn(T, sum(outs), generator=gen).to(act)
    y = y0.clone()
    wrapper(IDS).add_lora_linear(y, x, a, b, 1.0, outs)
    for t in range(T):
        one = y0[t:t + 1].clone()
        wrapper(IDS[t:t + 1]).add_lora_linear(one, x[t:t + 1], a, b, 1.0, outs)
        assert torch.equal(one[0], y[t]), t


@pytest.mark.parametrize("act", DTYPES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_shrink_assigns_and_expand_adds(act, as_tensor):
    """vLLM's sharded layers call add_shrink / add_expand directly, with one [n, T, r] float32
    buffer (or a tuple): the shrink assigns ``scale * x A^T``, the expand adds ``buf B^T`` at
    the slices' offsets from offset_start; -1 rows of the buffers and of y keep their bits."""
    gen = torch.Generator().manual_seed(3)
    w = wrapper(IDS)
    ids = w.token_lora_indices
    T, cols, rmax, outs = len(IDS), 40, 8, (24, 8, 8)
    a = tuple(slot_tensors((rmax, cols), act, gen) for _ in outs)
    b = tuple(slot_tensors((n, rmax), act, gen) for n in outs)
    x = torch.randn(T, cols, generator=gen).to(act)
    junk = torch.randn(len(outs), T, rmax, generator=gen)      # float32, as vLLM's buffers
    buf = junk.clone() if as_tensor else tuple(junk[i].clone() for i in range(len(outs)))
    before = lv.stats()
    w.add_shrink(buf, x, a, 0.5)
    assert served(before, "add_shrink") == 3
    base = ids == -1
    for i in range(len(outs)):
        got = buf[i]
        ref = torch.zeros(T, rmax, dtype=torch.float64)
        for t, s in enumerate(ids.tolist()):
            if s >= 0:
                ref[t] = 0.5 * x[t].double() @ a[i][s, 0].double().T
        assert torch.equal(got[base], junk[i][base])
        err = (got[~base].double() - ref[~base]).abs().max().item()
        assert err <= 1e-5 * (ref.abs().max().item() + 1)
    y = torch.randn(T, 5 + sum(outs), generator=gen).to(act)
    y0 = y.clone()
    w.add_expand(y, buf, b, outs, offset_start=5)
    assert served(before, "add_expand") == 3
    assert torch.equal(y[:, :5], y0[:, :5])
    off = 5
    for i, n in enumerate(outs):
        check_close(y[:, off:off + n], y0[:, off:off + n], expand_term(buf[i], b[i], ids), act)
        off += n
    assert torch.equal(y[base], y0[base])


@pytest.mark.parametrize("act", DTYPES)
def test_expand_without_add_inputs_assigns(act):
    gen = torch.Generator().manual_seed(4)
    w = wrapper(IDS)
    ids = w.token_lora_indices
    T, rmax, n = len(IDS), 8, 20
    b = (slot_tensors((n, rmax), act, gen),)
    buf = (torch.randn(T, rmax, generator=gen),)
    y = torch.randn(T, n, generator=gen).to(act)
    y0 = y.clone()
    w.add_expand(y, buf, b, (n,), add_inputs=False)
    term = expand_term(buf[0], b[0], ids)
    base = ids == -1
    check_close(y[~base], torch.zeros_like(y0[~base]), term[~base], act)
    assert torch.equal(y[base], y0[base])


@pytest.mark.parametrize("act", DTYPES)
def test_add_lora_embedding(act):
    """vLLM gathers the embedding's A rows itself; the wrapper adds ``x B^T``."""
    gen = torch.Generator().manual_seed(5)
    w = wrapper(IDS)
    ids = w.token_lora_indices
    T, rmax, dim = len(IDS), 16, 31
    b = slot_tensors((dim, rmax), act, gen)
    pad_rank(torch.zeros(SLOTS, 1, rmax, 1), b, 9)
    x = torch.randn(T, rmax, generator=gen).to(act)
    y = torch.randn(T, dim, generator=gen).to(act)
    y0 = y.clone()
    before = lv.stats()
    w.add_lora_embedding(y, x, b, add_inputs=True)
    assert served(before, "add_lora_embedding") == 1
    check_close(y, y0, expand_term(x, b, ids), act)
    assert torch.equal(y[ids == -1], y0[ids == -1])


@pytest.mark.parametrize("act", DTYPES)
@pytest.mark.parametrize("prefill", [True, False])
def test_add_lora_logits_padded_vocab(act, prefill):
    """Rows follow sampler_indices (one per request in a prefill); y is wider than B's rows
    (vLLM pads the vocab to a multiple of 64): the padding columns keep their bits."""
    gen = torch.Generator().manual_seed(6)
    tokens = [7, 7, 7, 0, 0, 9, 9, 8]
    prompts = [7, 0, 9, 8]
    w = wrapper(tokens, prompts, prefill=prefill)
    rows = w.sampler_indices
    assert rows.tolist() == [0, -1, 2, 1]
    hidden, rmax, vocab, padded = 48, 8, 100, 128
    a = slot_tensors((rmax, hidden), act, gen)
    b = slot_tensors((vocab, rmax), act, gen)
    x = torch.randn(len(prompts), hidden, generator=gen).to(act)
    y = torch.randn(len(prompts), padded, generator=gen).to(act)
    y0 = y.clone()
    before = lv.stats()
    w.add_lora_logits(y, x, a, b, 1.0)
    assert served(before, "add_lora_logits") == 1
    check_close(y[:, :vocab], y0[:, :vocab], ref_term(x, a, b, rows, 1.0), act)
    assert torch.equal(y[:, vocab:], y0[:, vocab:])
    assert torch.equal(y[1], y0[1])


def test_stock_wrapper_gets_base_rows_wrong():
    """Why the -1 rule matters: vLLM's stock CPU ops read slot -1 as the last slot."""
    gen = torch.Generator().manual_seed(7)
    ids = [7, 0, 9]
    a = (slot_tensors((4, 8), torch.float32, gen),)
    b = (slot_tensors((6, 4), torch.float32, gen),)
    x = torch.randn(3, 8, generator=gen)
    y0 = torch.zeros(3, 6)
    stock = PunicaWrapperCPU(256, 16, "cpu")
    stock.update_metadata(LoRAMapping(tuple(ids), tuple(ids), is_prefill=True), [7, 8, 9],
                          SLOTS, 1000)
    y_stock, y_ours = y0.clone(), y0.clone()
    stock.add_lora_linear(y_stock, x, a, b, 1.0, (6,))
    wrapper(ids).add_lora_linear(y_ours, x, a, b, 1.0, (6,))
    assert not torch.equal(y_stock[1], y0[1])      # the base row got slot 2's adapter
    assert torch.equal(y_ours[1], y0[1])
    assert torch.allclose(y_stock[[0, 2]], y_ours[[0, 2]], rtol=1e-5, atol=1e-5)


def test_slot_rewritten_between_calls():
    """vLLM copies a new adapter into a slot in place between steps: the next call uses it."""
    gen = torch.Generator().manual_seed(8)
    w = wrapper(IDS)
    ids = w.token_lora_indices
    T, cols, rmax, n = len(IDS), 24, 8, 12
    a = (slot_tensors((rmax, cols), torch.float32, gen),)
    b = (slot_tensors((n, rmax), torch.float32, gen),)
    x = torch.randn(T, cols, generator=gen)
    y0 = torch.randn(T, n, generator=gen)
    y = y0.clone()
    w.add_lora_linear(y, x, a, b, 1.0, (n,))
    # a rank-3 adapter replaces slot 1 (vLLM's reset_lora, then set_lora's copy_)
    a[0][1] = 0
    b[0][1] = 0
    a[0][1, 0, :3].copy_(torch.randn(3, cols, generator=gen))
    b[0][1, 0, :, :3].copy_(torch.randn(n, 3, generator=gen))
    # and slot 0 is emptied
    a[0][0] = 0
    b[0][0] = 0
    y = y0.clone()
    w.add_lora_linear(y, x, a, b, 1.0, (n,))
    check_close(y, y0, ref_term(x, a[0], b[0], ids, 1.0), torch.float32)
    assert torch.equal(y[ids == 0], y0[ids == 0])


def test_rank_trimming_matches_padding():
    """Skipping a slot's zero-padded ranks gives the result of the padded computation."""
    gen = torch.Generator().manual_seed(9)
    T, cols, rmax, n = len(IDS), 64, 32, 40
    a = (slot_tensors((rmax, cols), torch.float32, gen),)
    b = (slot_tensors((n, rmax), torch.float32, gen),)
    pad_rank(a[0], b[0], 8)
    x = torch.randn(T, cols, generator=gen)
    y0 = torch.randn(T, n, generator=gen)
    got = {}
    for trim in (True, False):
        lvv.TRIM_RANK = trim
        try:
            y = y0.clone()
            wrapper(IDS).add_lora_linear(y, x, a, b, 1.0, (n,))
            got[trim] = y
        finally:
            lvv.TRIM_RANK = True
    check_close(got[True], y0, ref_term(x, a[0], b[0], wrapper(IDS).token_lora_indices, 1.0),
                torch.float32)
    assert torch.allclose(got[True], got[False], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("what", ["y", "slots"])
def test_a_call_the_kernels_cannot_serve_takes_the_grouped_torch_path(what):
    """A float64 y, or float64 slot tensors (no kernel takes them): the grouped torch path,
    correct (-1 rows untouched), with one warning naming the method."""
    gen = torch.Generator().manual_seed(10)
    w = wrapper(IDS)
    ids = w.token_lora_indices
    T, cols, rmax, n = len(IDS), 16, 4, 8
    lora_dtype = torch.float64 if what == "slots" else torch.float32
    act = torch.float64 if what == "y" else torch.float32
    a = (slot_tensors((rmax, cols), lora_dtype, gen),)
    b = (slot_tensors((n, rmax), lora_dtype, gen),)
    x = torch.randn(T, cols, generator=gen, dtype=act)
    y0 = torch.randn(T, n, generator=gen, dtype=act)
    before = lv.stats()
    lv._warned.clear()      # the warning is once per process: start this test afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            y = y0.clone()
            w.add_lora_linear(y, x, a, b, 1.0, (n,))
    msgs = [str(c.message) for c in caught if "add_lora_linear" in str(c.message)]
    assert len(msgs) == 1 and "float64" in msgs[0] and "grouped torch" in msgs[0]
    assert lv.stats().get("torch:add_lora_linear", 0) - before.get("torch:add_lora_linear", 0) == 2
    assert served(before, "add_lora_linear") == 0
    term = ref_term(x, a[0], b[0], ids, 1.0)
    assert torch.allclose(y.double(), y0.double() + term, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[ids == -1], y0[ids == -1])


def test_no_adapter_in_the_batch_leaves_y_alone():
    gen = torch.Generator().manual_seed(11)
    w = wrapper([0, 0, 0])
    a = (slot_tensors((4, 8), torch.bfloat16, gen),)
    b = (slot_tensors((6, 4), torch.bfloat16, gen),)
    y0 = torch.randn(3, 6, generator=gen).to(torch.bfloat16)
    y = y0.clone()
    w.add_lora_linear(y, torch.randn(3, 8, generator=gen).to(torch.bfloat16), a, b, 1.0, (6,))
    assert torch.equal(y, y0)


@pytest.mark.parametrize("act", DTYPES)
def test_expert_lora_w13_and_w2(act):
    """The MoE hooks vLLM's LoRA experts call: w13 per slice (gate, up) at its column offset of
    ``y [T, k, 2I]``, w2 on ``y [T, k, H]`` weighted by the router, only for the (token,
    expert) pairs routed; base tokens' rows keep their bits."""
    gen = torch.Generator().manual_seed(12)
    ids_lora = [7, 0, 9, 8, 7, 0]
    w = wrapper(ids_lora)
    ids = w.token_lora_indices
    T, E, k, H, I, rmax = len(ids_lora), 4, 2, 32, 24, 8
    a13 = tuple(torch.randn(SLOTS, E, rmax, H, generator=gen).to(act) for _ in range(2))
    b13 = tuple(torch.randn(SLOTS, E, I, rmax, generator=gen).to(act) for _ in range(2))
    a2 = (torch.randn(SLOTS, E, rmax, I, generator=gen).to(act),)
    b2 = (torch.randn(SLOTS, E, H, rmax, generator=gen).to(act),)
    a13[0][1, 2, 5:] = 0                       # a true rank under the padding, one expert
    x = torch.randn(T, H, generator=gen).to(act)
    topk = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    y = torch.randn(T, k, 2 * I, generator=gen).to(act)
    y0 = y.clone()
    before = lv.stats()
    routing = w.add_lora_w13(y, x, a13, b13, topk, weights, None, None, None, T, k, SLOTS,
                             None, E, k, 2, False, False)
    assert served(before, "add_lora_w13") == 2
    term = torch.zeros(T, k, 2 * I, dtype=torch.float64)
    for t, s in enumerate(ids.tolist()):
        for j in range(k):
            e = int(topk[t, j])
            if s >= 0:
                for i in range(2):
                    term[t, j, i * I:(i + 1) * I] = (x[t].double() @ a13[i][s, e].double().T
                                                     @ b13[i][s, e].double().T)
    check_close(y.view(T * k, -1), y0.view(T * k, -1), term.view(T * k, -1), act)
    assert torch.equal(y[ids == -1], y0[ids == -1])
    h = torch.randn(T * k, I, generator=gen).to(act)
    y2 = torch.randn(T, k, H, generator=gen).to(act)
    y20 = y2.clone()
    w.add_lora_w2(y2, h, a2, b2, weights, *routing[:3], routing[3], T, None, None, k, SLOTS,
                  None, k, False, 0, False)
    assert served(before, "add_lora_w2") == 1
    term2 = torch.zeros(T, k, H, dtype=torch.float64)
    for t, s in enumerate(ids.tolist()):
        for j in range(k):
            e = int(topk[t, j])
            if s >= 0:
                term2[t, j] = float(weights[t, j]) * (h[t * k + j].double() @ a2[0][s, e].double().T
                                                      @ b2[0][s, e].double().T)
    check_close(y2.view(T * k, -1), y20.view(T * k, -1), term2.view(T * k, -1), act)
    assert torch.equal(y2[ids == -1], y20[ids == -1])
