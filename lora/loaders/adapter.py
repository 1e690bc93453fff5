"""`LoraAdapter`, and the build phase both loaders share.

The loaders (`lora.peft`, `lora.gguf`) work in two phases.  The *parse* phase reads the file with
its own library, checks every tensor -- both halves of every pair present, shapes that pair, a
supported dtype, finite values -- and brings each pair into this library's layout
(``a [rank, cols]``, ``b [rows, rank]``, base ``[rows, cols] = [n_out, n_in]``) as a `Pair`.
Only when the whole file has passed does the *build* phase here (`build_adapter`) copy the pairs
into `LoraDelta` storage, so a bad file never yields a half-loaded adapter.  Every problem with a
file is a `LoraFormatError` whose message starts with the file's path and names the tensor (or
config key): `format_error` writes it.
"""

import operator
import os
import re
import warnings
from collections.abc import Mapping

import numpy as np

from .. import _formats as formats
from .._byvalue import ByValue
from ..kinds.delta import LoraDelta, peft_delta
from ..kinds.dora import DoraDelta
from ..kinds.experts import LoraExperts
from ..errors import LoraFormatError, LoraShapeError
from ..scale import F32_OVERFLOW, LoraScale

__all__ = ["LoraAdapter"]


# Token ids are int64 wherever they are used (NumPy and torch id arrays): the largest one
TOKEN_ID_MAX = 2 ** 63 - 1


def _int_arg(value, what, minimum, maximum=None):
    """``value`` as an int >= ``minimum`` (and <= ``maximum`` when given): an int or NumPy
    integer, not a bool (TypeError), not out of range (ValueError); the messages name ``what``."""
    want = f"integers >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    if not isinstance(value, (bool, np.bool_)):
        try:
            value = operator.index(value)
        except TypeError:
            pass
        else:
            if value < minimum or (maximum is not None and value > maximum):
                raise ValueError(f"{what}: want {want}, got {value}")
            return value
    raise TypeError(f"{what}: want {want}, got {value!r}")


def _invocation_tokens(tokens):
    """None, or a non-empty tuple of non-negative int token ids.  An empty sequence is plain LoRA,
    as in PEFT (which tests the list's truth) and llama.cpp (an empty sequence never activates)."""
    if tokens is None:
        return None
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise TypeError(f"invocation_tokens must be a sequence of token ids, got {tokens!r}")
    return tuple(_int_arg(t, "invocation_tokens", 0, TOKEN_ID_MAX) for t in tokens) or None


# Hugging Face <-> GGUF names of the Llama family (llama.cpp's convert_hf_to_gguf.py tensor map)
_GGUF_TO_HF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_TO_HF_MODEL = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)")
_NAME_MAPS = {
    # to: (whole-model names, block pattern, block part map, block name format)
    "hf": (_GGUF_TO_HF_MODEL, _GGUF_BLOCK, _GGUF_TO_HF_BLOCK, "model.layers.{}.{}"),
    "gguf": ({v: k for k, v in _GGUF_TO_HF_MODEL.items()}, _HF_BLOCK,
             {v: k for k, v in _GGUF_TO_HF_BLOCK.items()}, "blk.{}.{}.weight"),
}
# attn_q / attn_k rows are permuted by llama.cpp's converter; the heads they are split over
_ROPE_PERMUTED = {"attn_q": "n_head", "attn_k": "n_head_kv"}


def _renamed_target(name, to):
    """(the name in convention ``to``, the GGUF block part such as "attn_q", or None); None
    when ``name`` is outside the Llama-family map (a name already in ``to`` included)."""
    model_names, block, parts, fmt = _NAME_MAPS[to]
    if name in model_names:
        return model_names[name], None
    m = block.fullmatch(name)
    if m is None or m.group(2) not in parts:
        return None
    part = parts[m.group(2)]
    return fmt.format(m.group(1), part), (m.group(2) if to == "hf" else part)


def llama_rope_permutation(n, heads):
    """llama.cpp's q/k row order (convert_hf_to_gguf.py ``LlamaModel.permute``) for ``n`` rows
    over ``heads`` heads: ``gguf_rows = hf_rows[perm]``, an int64 array ``[n]``.  Raises
    ``ValueError`` when ``n`` is not a multiple of ``2 * heads``."""
    if heads < 1 or n % (2 * heads):
        raise ValueError(f"{n} rows cannot be split over {heads} heads of two rotary halves "
                         f"(rows must be a multiple of 2 * heads = {2 * heads})")
    return np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(n)


def _restore(deltas, name, alpha, scale, invocation_tokens, peft_zero_alpha):
    """Unpickling (and deep copies): see `LoraAdapter._parts`."""
    adapter = LoraAdapter(deltas, name=name, alpha=alpha, scale=scale,
                          invocation_tokens=invocation_tokens)
    adapter._peft_zero_alpha = frozenset(k for k in peft_zero_alpha if k in adapter)
    return adapter


class LoraAdapter(ByValue, Mapping):
    """One loaded adapter: a read-only Mapping from the file's own base names to `LoraDelta` (or
    `LoraExperts`, for the routed experts of a mixture-of-experts layer).

    Keys are PEFT module paths (``"model.layers.0.self_attn.q_proj"``, without PEFT's
    ``base_model.model.`` prefix) or GGUF base tensor names (``"blk.0.attn_q.weight"``), in file
    order.  Every delta shares the adapter's one `LoraScale`, so ``adapter.scale.set(0.5)``
    rescales every projection at once.

    Attributes: ``name`` (str), ``alpha`` (the file's default alpha: PEFT ``lora_alpha`` or GGUF
    ``adapter.lora.alpha``, 0.0 when absent; per-module alphas are on the deltas), ``scale`` (the
    shared `LoraScale`), ``dtype`` (the storage dtype all deltas share, or ``"mixed"``),
    ``resident_bytes`` (the sum over the deltas) and ``invocation_tokens`` (activated LoRA's
    invocation sequence, or None; see `alora_mask`).

    Built by `load_peft` / `load_gguf`; it can also wrap deltas built by hand, which must all share
    ``scale`` (else ``ValueError``); ``invocation_tokens`` is None or a sequence of non-negative
    int token ids (``TypeError`` / ``ValueError`` otherwise; an empty one means plain LoRA).

    Pickling and ``copy.deepcopy`` keep every delta by value, the name, alpha, invocation
    tokens and the one `LoraScale` every delta shares (shared again after loading);
    ``copy.copy`` is a new adapter of the same deltas and LoraScale.
    """

    __slots__ = ("_deltas", "_name", "_alpha", "_scale", "_invocation_tokens", "_peft_zero_alpha")

    def __init__(self, deltas, *, name, alpha, scale, invocation_tokens=None):
        if not isinstance(scale, LoraScale):
            raise TypeError(f"scale must be a LoraScale, got {type(scale).__name__}")
        items = dict(deltas)
        for key, delta in items.items():
            if not isinstance(key, str):
                raise TypeError(f"adapter target names must be str, got {key!r}")
            if not isinstance(delta, (LoraDelta, DoraDelta, LoraExperts)):
                raise TypeError(f"target {key!r}: expected a LoraDelta, DoraDelta or LoraExperts, "
                                f"got {type(delta).__name__}")
            if delta.scale is not scale:
                raise ValueError(f"target {key!r}: every delta of an adapter must share its LoraScale")
        self._deltas = items
        self._name = str(name)
        self._alpha = float(alpha)
        self._scale = scale
        self._invocation_tokens = _invocation_tokens(invocation_tokens)
        # targets built under PEFT's alpha-0 rule (a zero delta; see build_adapter)
        self._peft_zero_alpha = frozenset()

    def _parts(self):
        """By value (lora._byvalue): the deltas by name, name, alpha, LoraScale, tokens."""
        return _restore, (dict(self._deltas), self._name, self._alpha, self._scale,
                          self._invocation_tokens, tuple(self._peft_zero_alpha))

    # Mapping protocol
    def __getitem__(self, name):
        return self._deltas[name]

    def __iter__(self):
        return iter(self._deltas)

    def __len__(self):
        return len(self._deltas)

    def __contains__(self, name):
        return name in self._deltas

    @property
    def name(self):
        """The adapter's name: the PEFT directory name, or GGUF ``general.name`` (else file stem)."""
        return self._name

    @property
    def alpha(self):
        """The file's default alpha (float): PEFT ``lora_alpha`` / GGUF ``adapter.lora.alpha``."""
        return self._alpha

    @property
    def scale(self):
        """The `LoraScale` every delta of this adapter shares (llama.cpp's user scale)."""
        return self._scale

    @property
    def dtype(self):
        """The storage dtype shared by every delta (``"float32"`` etc.), or ``"mixed"``."""
        kinds = {d.dtype for d in self._deltas.values()}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def resident_bytes(self):
        """Bytes held by all deltas: the sum of ``LoraDelta.resident_bytes``."""
        return sum(d.resident_bytes for d in self._deltas.values())

    def check_base(self, shapes):
        """Check the adapter against a base model's shapes.

        ``shapes`` maps base names to ``(rows, cols)`` = ``(n_out, n_in)`` -- also for PEFT
        ``fan_in_fan_out`` models, whose stored weights are ``[in, out]`` -- or to anything with a
        ``.shape`` (a weight array).  Raises `LoraShapeError` naming the tensor and both shapes for
        a target whose shape differs, and for a target missing from ``shapes``; base names the
        adapter does not target are ignored.  Returns None.
        """
        for key, delta in self._deltas.items():
            want = getattr(delta, "expert_shape", None) or (delta.rows, delta.cols)
            what = "experts" if len(want) == 3 else "delta"
            if key not in shapes:
                raise LoraShapeError(
                    f"adapter target '{key}' {_dims(want)} is missing from the base shapes",
                    rows=delta.rows, cols=delta.cols, rank=delta.rank)
            given = shapes[key]
            given = getattr(given, "shape", given)
            try:
                got = tuple(int(v) for v in given)
            except (TypeError, ValueError):
                got = None
            if got != want:
                shown = _dims(got) if got is not None and len(got) in (2, 3) else repr(given)
                layout = "(n_experts x rows x cols)" if what == "experts" else "(rows x cols)"
                raise LoraShapeError(
                    f"tensor '{key}': the adapter's {what} {_dims(want)} {layout} but the base "
                    f"is {shown}", rows=delta.rows, cols=delta.cols, rank=delta.rank)

    @property
    def invocation_tokens(self):
        """Activated LoRA's invocation sequence: a tuple of int token ids, or None for plain LoRA.
        From PEFT's ``alora_invocation_tokens`` or GGUF ``adapter.alora.invocation_tokens``."""
        return self._invocation_tokens

    def alora_mask(self, token_ids):
        """Where this adapter applies in a token sequence: numpy bool ``[n]``.

        ``token_ids``: the whole sequence so far (prompt and generated tokens), a 1-D integer
        array-like -- a list, a NumPy array or a CPU torch tensor.  Plain LoRA: all True.
        Activated LoRA: True from the start of the *last* occurrence of `invocation_tokens` to the
        end, all False when the sequence does not occur (PEFT's ``calculate_alora_offsets``).
        With a bank: ``adapter_ids = np.where(mask, slot, -1)``.

        Raises ``TypeError`` for bool, float or other non-integer ids and ``ValueError`` for a
        sequence that is not 1-D.
        """
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D [n], got shape {ids.shape}")
        if ids.size and ids.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be integers, got dtype {ids.dtype}")
        n = ids.shape[0]
        tokens = self._invocation_tokens
        if tokens is None:
            return np.ones(n, dtype=bool)
        mask = np.zeros(n, dtype=bool)
        k = len(tokens)
        if n >= k:
            windows = np.lib.stride_tricks.sliding_window_view(ids, k)
            starts = np.flatnonzero((windows == np.asarray(tokens)).all(axis=1))
            if starts.size:
                mask[starts[-1]:] = True
        return mask

    def renamed(self, to, *, n_head, n_head_kv):
        """The same adapter under the other naming convention: a new `LoraAdapter` that shares
        this one's `LoraScale` (and name, alpha, invocation tokens), for the Llama family.

        ``to="hf"``: GGUF names -> Hugging Face module paths; ``to="gguf"``: the reverse.  The
        map: ``blk.N.attn_q/attn_k/attn_v/attn_output.weight`` <->
        ``model.layers.N.self_attn.{q,k,v,o}_proj``, ``blk.N.ffn_gate/ffn_up/ffn_down.weight``
        <-> ``model.layers.N.mlp.{gate,up,down}_proj``, ``token_embd.weight`` <->
        ``model.embed_tokens``, ``output.weight`` <-> ``lm_head``.  llama.cpp's converter
        reorders the rows of attn_q (over ``n_head`` heads) and attn_k (over ``n_head_kv``) for
        its RoPE layout, ``gguf_rows = hf_rows[perm]`` (`llama_rope_permutation`): ``to="hf"``
        undoes it on lora_b, ``to="gguf"`` applies it; lora_a is never permuted.  The factors
        keep their storage dtype and bits; alpha, rsLoRA and PEFT's alpha-0 rule carry over, so
        every ``effective_scale`` is unchanged.  The caller vouches that the model is of the
        Llama family.

        Raises `LoraFormatError` naming a target outside the map (one already in the ``to``
        convention included), ``ValueError`` for another ``to``, non-positive head counts, or
        q/k rows that are not a multiple of ``2 * heads``; ``TypeError`` for non-integer heads.
        Nothing is built unless every target renames.
        """
        if to not in _NAME_MAPS:
            raise ValueError(f"to must be 'hf' or 'gguf', got {to!r}")
        heads = {"n_head": _int_arg(n_head, "n_head", 1),
                 "n_head_kv": _int_arg(n_head_kv, "n_head_kv", 1)}
        plan = []
        for name, delta in self._deltas.items():
            renamed = _renamed_target(name, to)
            if renamed is None:
                other = "Hugging Face" if to == "hf" else "GGUF"
                raise LoraFormatError(
                    f"adapter '{self._name}': target '{name}' has no {other} name in the Llama "
                    f"family map (blk.N.attn_q/k/v/output, ffn_gate/up/down, token_embd, output "
                    f"<-> model.layers.N.self_attn/mlp.*_proj, model.embed_tokens, lm_head)")
            if isinstance(delta, DoraDelta):
                raise LoraFormatError(f"adapter '{self._name}': target '{name}' is a DoRA delta; "
                                      f"GGUF has no DoRA, so it has no other naming to move to")
            new_name, part = renamed
            perm = None
            if part in _ROPE_PERMUTED:
                which = _ROPE_PERMUTED[part]
                try:
                    perm = llama_rope_permutation(delta.rows, heads[which])
                except ValueError as exc:
                    raise ValueError(f"adapter '{self._name}': target '{name}' ({which} = "
                                     f"{heads[which]}): {exc}") from None
                if to == "hf":
                    perm = np.argsort(perm)
            plan.append((name, new_name, delta, perm))
        deltas, zeroed = {}, []
        for name, new_name, delta, perm in plan:
            a, b = delta.lora_weights()
            fa, fb = delta.dtypes
            if perm is not None and formats.BY_NAME[fb].block > 1:
                fb = "float32"   # rows moved across blocks: the exact values, never re-quantized
            make = peft_delta if name in self._peft_zero_alpha else LoraDelta._of
            deltas[new_name] = make(a, b if perm is None else b[perm], alpha=delta.alpha,
                                    scale=self._scale, rslora=delta.rslora,
                                    dtype=formats.pair_name(fa, fb))
            if name in self._peft_zero_alpha:
                zeroed.append(new_name)
        adapter = LoraAdapter(deltas, name=self._name, alpha=self._alpha, scale=self._scale,
                              invocation_tokens=self._invocation_tokens)
        adapter._peft_zero_alpha = frozenset(zeroed)
        return adapter

    def __repr__(self):
        alora = "" if self._invocation_tokens is None else \
            f", invocation_tokens={list(self._invocation_tokens)}"
        return (f"LoraAdapter(name={self._name!r}, targets={len(self)}, alpha={self._alpha:g}, "
                f"scale={self._scale.value:g}, dtype={self.dtype!r}, "
                f"resident_bytes={self.resident_bytes}{alora})")


def _dims(shape):
    """``[3 x 4]`` or ``[8 x 3 x 4]``."""
    return "[" + " x ".join(str(v) for v in shape) + "]"


# --------------------------------------------------------------------------------------------
# the build phase, shared by the PEFT and GGUF loaders
# --------------------------------------------------------------------------------------------


class Pair:
    """One validated target in our layout, before it becomes a `LoraDelta` (2-D factors) or a
    `LoraExperts` (3-D: a [E, rank, cols], b [E, rows, rank])."""

    __slots__ = ("name", "a", "b", "alpha", "rslora", "zero_alpha", "storage", "tensors",
                 "dora")

    def __init__(self, name, a, b, *, alpha, rslora, zero_alpha, storage, tensors):
        self.name, self.a, self.b = name, a, b        # a [rank, cols], b [rows, rank]
        self.alpha, self.rslora, self.zero_alpha = alpha, rslora, zero_alpha
        # "float32" | "float16" | "bfloat16" | "q8_0", or A's and B's ("q8_0/float16"); a or b
        # may be a `lora._formats.Stored` (a file's Q8_0 blocks, kept as they are)
        self.storage = storage
        self.tensors = tensors                        # the file's two tensor names, for messages
        # DoRA: (magnitude, base weight [rows, cols] (a view), embedding rule, magnitude key)
        self.dora = None




def format_error(path, what, tensor=None, key=None, pair=None):
    """A one-line `LoraFormatError`: ``"<path>: tensor '<t>': <what>"`` (or ``tensors '<a>' and
    '<b>'``, ``key '<k>'``), so every refusal names the file and what in it is wrong."""
    where = os.fspath(path)
    if tensor is not None:
        where += f": tensor '{tensor}'"
    if pair is not None:
        where += f": tensors '{pair[0]}' and '{pair[1]}'"
    if key is not None:
        where += f": key '{key}'"
    return LoraFormatError(f"{where}: {what}")


def storage_arg(dtype):
    """Normalise the ``dtype=`` argument: None, or one of the storage dtype names."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in formats.NAMES:
        raise ValueError(f"dtype must be None, {formats.QUOTED}, got {dtype!r}")
    return name


def scale_arg(scale):
    """The ``scale=`` argument as the `LoraScale` every delta will share (a float makes a new one;
    `LoraScale` refuses a value that is not finite in float32)."""
    return scale if isinstance(scale, LoraScale) else LoraScale(scale)


def pair_storage(dtype_a, dtype_b):
    """The storage dtype that keeps both halves exactly: their common dtype, else float32."""
    return dtype_a if dtype_a == dtype_b else "float32"


def check_finite(path, tensor, arr):
    """`LoraFormatError` naming the tensor when ``arr`` holds inf or NaN."""
    # isfinite works for float16 and ml_dtypes.bfloat16 without widening the array.
    if arr.size and not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise format_error(path, f"holds {bad} non-finite value(s) (inf or NaN)", tensor=tensor)


def _build_one(p, path, scale, dtype, deltas, zeroed):
    """One validated `Pair` into ``deltas`` (its name into ``zeroed`` under PEFT's alpha-0 rule)."""
    storage = dtype or p.storage
    try:
        # Overflow into a narrower storage dtype is refused below (the core raises
        # ValueError); NumPy's cast warning on the way there would only repeat it.
        with np.errstate(over="ignore"):
            if p.a.ndim == 3:  # routed experts: a [E, rank, cols], b [E, rows, rank]
                make = LoraExperts._of if isinstance(p.a, formats.Stored) else LoraExperts
                delta = make(p.a, p.b, alpha=p.alpha, scale=scale, rslora=p.rslora,
                             dtype=storage)
                if p.zero_alpha and delta.alpha == 0:
                    delta._zero_alpha()
            elif isinstance(p.a, formats.Stored):  # a file's blocks, kept as they are
                delta = LoraDelta._of(p.a, p.b, alpha=p.alpha, scale=scale, rslora=p.rslora,
                                      dtype=storage)
            else:
                make = peft_delta if p.zero_alpha else LoraDelta
                delta = make(p.a, p.b, alpha=p.alpha, scale=scale, rslora=p.rslora,
                             dtype=storage)
    except NotImplementedError:
        raise
    except (ValueError, TypeError) as exc:
        raise format_error(path, f"cannot be stored as {storage}: {exc}", pair=p.tensors) from exc
    if p.dora is not None:
        magnitude, base, embedding, mag_key = p.dora
        try:
            delta = DoraDelta._over(delta, magnitude, base, embedding)
        except (ValueError, TypeError) as exc:
            raise format_error(path, f"DoRA module '{p.name}': {exc}", tensor=mag_key) from exc
    if not abs(delta.effective_scale) < F32_OVERFLOW:
        raise format_error(path, f"alpha {p.alpha:g} at rank {delta.rank} gives the effective "
                                 f"scale {delta.effective_scale:g} (scale x alpha factor), "
                                 f"which is not finite in float32", pair=p.tensors)
    if p.zero_alpha:
        zeroed.append(p.name)
    deltas[p.name] = delta


def build_adapter(pairs, *, path, name, alpha, scale, dtype, invocation_tokens=None):
    """Phase two: copy validated `Pair`s into `LoraDelta` storage, all sharing ``scale``, and
    return the `LoraAdapter`; nothing is returned on error.  ``dtype`` None keeps each pair's
    storage dtype.  Pairs with ``zero_alpha`` follow PEFT's alpha-0 rule (a zero delta, through
    `lora.delta.peft_delta`), with one ``UserWarning`` naming them.  ``invocation_tokens``: the
    activated LoRA's validated sequence, or None."""
    deltas = {}
    zeroed, lost = [], []
    with formats.collect_losses() as losses:
        for p in pairs:
            _build_one(p, path, scale, dtype, deltas, zeroed)
            lost += [f"{p.name}.{what} {err:.1%}" + (f" ({n} block(s) all zero)" if n else "")
                     for what, err, n in losses]
            losses.clear()
    if lost:
        shown = ", ".join(lost[:3]) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
        warnings.warn(f"{os.fspath(path)}: stored as q8_0, {len(lost)} factor(s) are more than "
                      f"{formats.Q8_0_WARN_ERROR:.0%} off their values ({shown}): values this "
                      "small get a subnormal float16 block scale (below 7.75e-3; 0 below about "
                      "4e-6); load with dtype='bfloat16' or 'float16' to keep them",
                      RuntimeWarning, stacklevel=3)
    if zeroed:
        shown = ", ".join(zeroed[:3]) + (f" and {len(zeroed) - 3} more" if len(zeroed) > 3 else "")
        warnings.warn(f"{os.fspath(path)}: alpha is 0 for {len(zeroed)} module(s) ({shown}): "
                      "PEFT scales them by alpha / r = 0, so their deltas are zero",
                      UserWarning, stacklevel=3)
    adapter = LoraAdapter(deltas, name=name, alpha=alpha, scale=scale,
                          invocation_tokens=invocation_tokens)
    adapter._peft_zero_alpha = frozenset(zeroed)
    return adapter
