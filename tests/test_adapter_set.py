"""`AdapterSet`: named adapters in stable slots, live banks per target, hot swap under load."""

import os
import threading

import numpy as np
import pytest

import lora
from conftest import assert_same_bits, make_delta, rand

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
Q, O = "blk.0.attn_q.weight", "blk.0.attn_output.weight"


def adapter(rng, rank, shapes, dtype="float32", scale=1.0):
    """A plain {base name: LoraDelta} mapping sharing one LoraScale (what a loader returns)."""
    s = lora.LoraScale(scale)
    return {t: make_delta(rng, rank, r, c, dtype, alpha=2.0 * rank, scale=s)
            for t, (r, c) in shapes.items()}


SHAPES = {Q: (48, 40), O: (40, 48)}


def test_slots_names_and_mapping():
    rng = np.random.default_rng(0)
    a, b, c = (adapter(rng, r, SHAPES) for r in (2, 4, 8))
    s = lora.AdapterSet({"a": a, "b": b})
    assert (s.slot("a"), s.slot("b"), len(s), s.names) == (0, 1, 2, ["a", "b"])
    assert "a" in s and "z" not in s and list(s) == ["a", "b"] and s["b"] is b
    assert s.targets == {Q, O}
    assert s.slots(["b", None, "__base__", "a"]).tolist() == [1, -1, -1, 0]
    assert s.slots([]).dtype == np.int64
    with pytest.raises(KeyError, match="'zz'"):
        s.slots(["a", "zz"])
    with pytest.raises(ValueError, match="'a'"):
        s.add("a", c)
    with pytest.raises(KeyError, match="'zz'"):
        s.replace("zz", c)
    with pytest.raises(KeyError, match="'zz'"):
        s.remove("zz")
    with pytest.raises(ValueError, match="__base__"):
        s.add("__base__", c)
    with pytest.raises(TypeError):
        s.add("x", [1, 2])
    # remove frees the slot; add takes the lowest free one
    s.remove("a")
    assert s.names == ["b"] and s.slot("b") == 1
    assert s.add("c", c) == 0 and s.names == ["c", "b"]
    assert s.replace("c", a) == 0 and s["c"] is a
    total = sum(d.resident_bytes for d in list(a.values()) + list(b.values()))
    assert s.resident_bytes == total


def test_disagreeing_shapes_are_refused_and_the_set_unchanged():
    rng = np.random.default_rng(1)
    s = lora.AdapterSet({"a": adapter(rng, 2, SHAPES), "b": adapter(rng, 3, SHAPES)})
    bad = adapter(rng, 2, {Q: (48, 41)})
    before = (s.names, s.targets, s["a"])
    for call in (lambda: s.add("c", bad), lambda: s.replace("a", bad)):
        with pytest.raises(lora.LoraShapeError) as info:
            call()
        msg = str(info.value)
        assert Q in msg and "48 x 41" in msg and "48 x 40" in msg, msg
        assert (s.names, s.targets, s["a"]) == before
    # once "a" is the only adapter on Q, replacing it with a new shape is fine
    s.remove("b")
    s.replace("a", adapter(rng, 2, {Q: (48, 41)}))
    assert s.bank(Q).base_shape == (48, 41)


def test_bank_rows_equal_each_adapter_alone(isa, dtype):
    rng = np.random.default_rng(2)
    ads = {n: adapter(rng, r, SHAPES, dtype) for n, r in (("a", 3), ("b", 16), ("c", 5))}
    ads["o_only"] = adapter(rng, 4, {O: SHAPES[O]})  # does not target Q: adds nothing there
    s = lora.AdapterSet(ads)
    bank = s.bank(Q)
    names = ["a", None, "c", "b", "o_only", "a", "__base__", "b", "c"]
    ids = s.slots(names)
    n = len(names)
    x = rand(rng, (n, 40))
    out = rand(rng, (n, 48))
    scales = np.linspace(0.25, 2.0, n)
    got = bank.add_batch_to(x, out.copy(), ids, scales)
    for b, name in enumerate(names):
        want = out[b].copy()
        if name in ads and Q in ads[name]:
            d = ads[name][Q]
            keep = d.scale.value
            d.scale.set(keep * scales[b])
            d.add_to(x[b], want)
            d.scale.set(keep)
        assert_same_bits(got[b], want, f"row {b} ({name})")
    # embedding rows through the same set
    emb = lora.AdapterSet({"a": adapter(rng, 4, {"token_embd.weight": (100, 40)})})
    tok = np.array([3, 99, 0])
    got = emb.bank("token_embd.weight").add_rows_to(tok, np.zeros((3, 40), np.float32),
                                                    [0, -1, 0])
    want = np.zeros((3, 40), np.float32)
    emb["a"]["token_embd.weight"].add_rows_to(tok[[0, 2]], want[[0, 2]])
    d = emb["a"]["token_embd.weight"]
    for i in (0, 2):
        row = np.zeros(40, np.float32)
        d.add_row_to(int(tok[i]), row)
        assert_same_bits(got[i], row)
    assert not got[1].any()


def test_banks_are_live_and_free_slots_are_refused():
    rng = np.random.default_rng(3)
    a, b = adapter(rng, 2, SHAPES), adapter(rng, 6, SHAPES)
    s = lora.AdapterSet()
    bank = s.bank(Q)  # before any adapter targets Q: adds nothing, no shape yet
    assert bank.base_shape is None
    x, out = rand(rng, (2, 40)), rand(rng, (2, 48))
    assert_same_bits(bank.add_batch_to(x, out.copy(), [-1, -1]), out)
    s.add("a", a)
    s.add("b", b)
    assert bank.base_shape == (48, 40)
    first = bank.add_batch_to(x, out.copy(), [0, 1])
    assert_same_bits(first[0], a[Q].add_to(x[0], out[0].copy()))
    s.replace("a", b)  # seen at the bank's next call
    again = bank.add_batch_to(x, out.copy(), [0, 1])
    assert_same_bits(again[0], b[Q].add_to(x[0], out[0].copy()))
    s.remove("a")  # slot 0 is now free: using it is an error, not a silent no-op
    before = out.copy()
    with pytest.raises(IndexError, match="adapter id 0 at position 1"):
        bank.add_batch_to(x, out, [1, 0])
    with pytest.raises(IndexError, match="out of range"):
        bank.add_batch_to(x, out, [1, 5])
    assert_same_bits(out, before)


def test_a_bank_target_must_be_a_name():
    s = lora.AdapterSet({"a": adapter(np.random.default_rng(30), 2, SHAPES)})
    for bad in (3, None, b"blk.0.attn_q.weight", ("blk.0.attn_q.weight",)):
        with pytest.raises(TypeError, match="a bank's target is a base name"):
            s.bank(bad)


def test_a_bank_no_adapter_targets_warns_once_per_name():
    """A misspelt target would add nothing forever: without declared targets, a UserWarning at
    the user's line, once per name and set, when the bank is made (the set holds adapters) or
    first called (it held none when the bank was made); the bank stays live, adding nothing
    until an adapter targets the name."""
    import warnings

    rng = np.random.default_rng(31)
    typo = "blk.0.attn_q.weihgt"
    s = lora.AdapterSet({"a": adapter(rng, 2, SHAPES)})
    with pytest.warns(UserWarning, match=r"no adapter in the set targets 'blk\.0\.attn_q\.weihgt'"
                                         r".*did you mean 'blk\.0\.attn_q\.weight'") as got:
        bank = s.bank(typo)
    assert got[0].filename == __file__                         # the caller's line
    x, out = rand(rng, (2, 40)), rand(rng, (2, 48))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # once per name: no more
        s.bank(typo)
        assert_same_bits(bank.add_batch_to(x, out.copy(), [0, -1]), out)
        s.bank(Q)                                              # a name an adapter targets
    empty = lora.AdapterSet()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        late = empty.bank(typo)                                # nothing to compare with yet
    empty.add("a", adapter(rng, 2, SHAPES))
    with pytest.warns(UserWarning, match="no adapter in the set targets") as got:
        late.add_batch_to(x, out.copy(), [0, -1])
    assert got[0].filename == __file__
    s.add("b", adapter(rng, 3, {typo: (48, 40)}))              # the live-bank rule holds
    assert bank.base_shape == (48, 40)
    assert not np.array_equal(bank.add_batch_to(x, out.copy(), [1, 1]), out)


def test_declared_targets_check_every_name():
    """AdapterSet(targets=...): a bank name or an adapter target outside them is a KeyError
    naming the close ones (the set unchanged); a declared name no adapter targets yet is a live
    bank without any warning; pickles and copies keep the declaration."""
    import copy
    import pickle
    import warnings

    rng = np.random.default_rng(32)
    k = "blk.0.attn_k.weight"
    s = lora.AdapterSet({"a": adapter(rng, 2, SHAPES)}, targets=[Q, O, k])
    assert s.declared_targets == {Q, O, k}
    with pytest.raises(KeyError, match=r"not one of the set's declared targets; did you mean "
                                       r"'blk\.0\.attn_q\.weight'"):
        s.bank("blk.0.attn_q.weihgt")
    with pytest.raises(KeyError, match=r"adapter 'b' targets 'blk\.0\.ffn_up\.weight'"):
        s.add("b", adapter(rng, 2, {Q: (48, 40), "blk.0.ffn_up.weight": (40, 48)}))
    with pytest.raises(KeyError, match="declared targets"):
        s.replace("a", adapter(rng, 2, {"blk.0.ffn_up.weight": (40, 48)}))
    assert s.names == ["a"] and s.targets == {Q, O}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bank = s.bank(k)                                       # declared, not targeted yet
        x, out = rand(rng, (1, 40)), rand(rng, (1, 48))
        assert_same_bits(bank.add_batch_to(x, out.copy(), [0]), out)
    s.add("b", adapter(rng, 2, {k: (48, 40)}))
    assert bank.base_shape == (48, 40)
    for other in (pickle.loads(pickle.dumps(s)), copy.copy(s), copy.deepcopy(s)):
        assert other.declared_targets == {Q, O, k} and other.names == ["a", "b"]
    with pytest.raises(TypeError, match="base names"):
        lora.AdapterSet(targets=[Q, 3])
    with pytest.raises(TypeError, match="iterable"):
        lora.AdapterSet(targets=Q)


def test_a_loaded_adapter_joins_a_set():
    peft = lora.load_peft(os.path.join(FIXTURES, "peft_r8_alpha16"))
    s = lora.AdapterSet({"peft": peft})
    target = next(iter(peft))
    d = peft[target]
    rng = np.random.default_rng(4)
    x, out = rand(rng, (2, d.cols)), rand(rng, (2, d.rows))
    got = s.bank(target).add_batch_to(x, out.copy(), s.slots(["peft", None]))
    assert_same_bits(got[0], d.add_to(x[0], out[0].copy()))
    assert_same_bits(got[1], out[1])


def test_hot_swap_under_load(isa):
    """Callers run while another thread replaces and removes adapters: within every call, all
    rows of one slot come from one version of its adapter (the set at one instant), and nothing
    crashes (the sanitizer stage runs this too)."""
    rng = np.random.default_rng(5)
    shapes = {Q: (256, 192)}
    v1, v2 = adapter(rng, 8, shapes), adapter(rng, 16, shapes, "bfloat16")
    s = lora.AdapterSet({"x": v1, "y": v1})
    bank = s.bank(Q)
    n = 12
    x = rand(rng, (n, 192))
    ids = np.array([0, 1] * (n // 2))
    base = rand(rng, (n, 256))
    want = {tag: lora.LoraBank([a[Q]]).add_batch_to(x, base.copy(), np.zeros(n, np.int64))
            for tag, a in (("v1", v1), ("v2", v2))}
    errors, calls, stop = [], [0], threading.Event()

    def caller():
        try:
            while not stop.is_set():
                try:
                    got = bank.add_batch_to(x, base.copy(), ids)
                except IndexError:
                    continue  # "y" was removed at that instant: the whole call is refused
                calls[0] += 1
                for slot in (0, 1):
                    rows = got[ids == slot].tobytes()
                    if not any(rows == w[ids == slot].tobytes() for w in want.values()):
                        errors.append(f"slot {slot}: rows of one call from two versions")
                        return
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(400):
            new = v2 if i % 2 else v1
            s.replace("x", new)
            s.replace("y", new)
            if i % 40 == 0:
                s.remove("y")
                s.add("y", new)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert calls[0] > 0


def test_adapter_ids_are_required_and_torch_scales_of_any_float_dtype():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    d = make_delta(rng, 4, 48, 40)
    bank = lora.LoraBank([d])
    s = lora.AdapterSet({"a": {Q: d}})
    x, out = rand(rng, (2, 40)), rand(rng, (2, 48))
    before = out.copy()
    for b in (bank, s.bank(Q)):
        with pytest.raises(TypeError, match="adapter_ids"):
            b.add_batch_to(x, out, None)
        with pytest.raises(TypeError, match="adapter_ids"):
            b.add_rows_to([1, 2], np.zeros((2, 40), np.float32), None)
    assert_same_bits(out, before)
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        got = bank.add_batch_to(x, out.copy(), [0, 0], torch.tensor([0.5, 2.0], dtype=dt))
        assert_same_bits(got, bank.add_batch_to(x, out.copy(), [0, 0], [0.5, 2.0]))
    with pytest.raises(TypeError, match="bool"):
        bank.add_batch_to(x, out, [0, 0], torch.tensor([True, False]))
