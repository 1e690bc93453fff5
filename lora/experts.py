"""`LoraExperts`: LoRA on the routed experts of a mixture-of-experts layer.

A MoE layer holds ``n_experts`` expert matrices in one 3-D weight and routes each token to ``k``
of them.  Expert LoRA (PEFT ``target_parameters``, llama.cpp ``build_lora_mm_id``) gives expert
``e`` its own pair ``(A_e, B_e)`` and adds ``s * B_e (A_e x)`` for the (token, expert) pairs the
router chose only.  Layouts: ``a [n_experts, rank, cols]``, ``b [n_experts, rows, rank]``, one
expert's base ``[rows, cols] = [n_out, n_in]``.

One C call per `LoraExperts.add_to` (``lora_apply_experts``): the pairs are grouped by expert
(the bank's counting sort), each expert's factors stream once per block of pairs, and every
pair's row is bit-identical to ``expert(e).add_to`` on it alone.  The way to the call is
`lora._dispatch`'s; a bank of experts (`LoraBank.add_experts_to`, ``AdapterSet.bank``) takes
the same function, `apply_experts`, with adapter ids.
"""

import operator

import numpy as np

from . import _arrays as arrays
from . import _dtypes as dtypes
from ._byvalue import ByValue
from ._dispatch import (CHARS, ERR_ALIGN, INT64S, NULL, fast_code, from_buffer, ndarray,
                        run_batch)
from ._entries import EntryTable, Member, entry_type, with_scales
from ._lora_cffi import ffi, lib
from ._merge import finite_scale, merge_
from .delta import LoraDelta, alpha_factor, check_alpha, check_bits
from .errors import LoraShapeError
from .scale import LoraScale

__all__ = ["LoraExperts", "apply_experts"]

_I64 = arrays.I64
_apply = lib.lora_apply_experts
_ERR_INDEX = lib.LORA_ERR_INDEX
_ERR_ADAPTER = lib.LORA_ERR_ADAPTER
_cast = ffi.cast
_INT64P = ffi.typeof("int64_t *")
_VOIDP = ffi.typeof("void *")
_TORCH_CODES = arrays.TORCH_CODES  # filled in place at the first tensor
_TENSOR_MISS = (AttributeError, RuntimeError, TypeError, IndexError)
_note_write = arrays.note_write
_TORCH_INT64 = [None]  # torch.int64, bound with the torch codes


def _torch_init():
    codes = arrays.torch_init()
    _TORCH_INT64[0] = arrays.torch_module().int64
    return codes


def _pair_error(a, b):
    """The LoraShapeError for 3-D factors that do not make experts: both shapes as given."""
    rank = a.shape[1] if a.ndim == 3 else None
    rows = b.shape[1] if b.ndim == 3 else None
    cols = a.shape[2] if a.ndim == 3 else None
    why = []
    if a.ndim != 3 or b.ndim != 3:
        why.append("both must be 3-D (a LoraDelta takes one expert's 2-D pair)")
    else:
        if a.shape[0] != b.shape[0]:
            why.append(f"{a.shape[0]} experts in lora_a, {b.shape[0]} in lora_b")
        if a.shape[1] != b.shape[2]:
            why.append(f"rank {a.shape[1]} in lora_a, {b.shape[2]} in lora_b")
        if 0 in a.shape or 0 in b.shape:
            why.append("every dimension must be at least 1")
    return LoraShapeError(
        f"LoRA experts do not pair: lora_a has shape {a.shape} (want [n_experts, rank, cols]) "
        f"and lora_b {b.shape} (want [n_experts, rows, rank]): " + "; ".join(why),
        rows=rows, cols=cols, rank=rank, a_len=a.size, b_len=b.size)


def _restore(a_bits, b_bits, dtype, alpha, rslora, factor, scale):
    """Unpickling: experts from their stored bits (see `LoraExperts._parts`)."""
    return LoraExperts._from_bits(a_bits, b_bits, dtype, alpha, rslora, factor, scale)


@entry_type
class LoraExperts(ByValue):
    """LoRA on ``n_experts`` routed experts: adds ``s * B_e (A_e x)`` for the routed pairs only.

    ``LoraExperts(a, b, *, alpha=0.0, scale=1.0, rslora=False, dtype="float32")``

    - ``a``: ``[n_experts, rank, cols]``, ``b``: ``[n_experts, rows, rank]``: expert ``e``'s pair
      is ``(a[e], b[e])`` in `LoraDelta`'s layout; any real float array-like, copied into owned
      storage of ``dtype`` ("float32" | "float16" | "bfloat16", rounded to nearest even).
    - ``effective_scale = scale * alpha_factor`` with LoraDelta's rule (``alpha / rank``,
      ``alpha / sqrt(rank)`` with ``rslora``, 1 at alpha 0); one `LoraScale` (``scale``: a float
      or a LoraScale to share) for every expert.

    Raises ``LoraShapeError`` naming both shapes when the factors do not pair (3-D, one expert
    count, one rank, no empty dimension), ``TypeError`` for non-float arrays, ``ValueError`` for
    non-finite values or alpha, or values that overflow the storage dtype.

    ``expert(e)`` is expert ``e`` alone as a `LoraDelta` (sharing the storage and the
    LoraScale); ``add_to(x, out, expert_ids)`` applies the routed pairs; ``delta_weight()``,
    ``merge_into(w)`` / ``unmerge_from(w)`` work on the 3-D expert weight.  Pickling keeps the
    stored factors, dtype, alpha and the scale (shared LoraScales stay shared within one
    pickle); ``copy.copy`` shares storage and LoraScale, ``copy.deepcopy`` owns new ones.
    """

    __slots__ = ("_experts", "_n", "_rank", "_rows", "_cols", "_alpha", "_rslora", "_dtype",
                 "_scale", "_alpha_factor", "_table", "_xshape", "_oshape", "__weakref__")

    def __init__(self, a, b, *, alpha=0.0, scale=1.0, rslora=False, dtype="float32"):
        a = arrays.float_array(a, "lora_a")
        b = arrays.float_array(b, "lora_b")
        if (a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]
                or 0 in a.shape or 0 in b.shape):
            raise _pair_error(a, b)
        name = dtypes.storage_name(dtype)
        alpha = check_alpha(alpha, rslora)
        if not isinstance(scale, LoraScale):
            scale = LoraScale(scale)
        a_bits = dtypes.to_storage(a, name, "lora_a")
        b_bits = dtypes.to_storage(b, name, "lora_b")
        self._build(a_bits, b_bits, name, alpha, bool(rslora),
                    alpha_factor(alpha, a.shape[1], bool(rslora)), scale)

    @classmethod
    def _from_bits(cls, a_bits, b_bits, dtype, alpha, rslora, factor, scale):
        a_bits, b_bits = check_bits(a_bits, b_bits, dtype, a_ndim=3)
        if not isinstance(scale, LoraScale):
            raise TypeError(f"scale must be a LoraScale; got {type(scale).__name__}")
        self = cls.__new__(cls)
        self._build(a_bits, b_bits, dtypes.storage_name(dtype), check_alpha(alpha, rslora),
                    bool(rslora), check_alpha(factor, False), scale)
        return self

    @classmethod
    def _from_deltas(cls, deltas):
        """Experts from existing `LoraDelta`s, expert e being ``deltas[e]`` (package-internal:
        `accelerate_peft` serves PEFT's own tensors through views, `LoraDelta.view`).  They must
        agree on shape, rank, dtype, alpha factor and share one LoraScale (ValueError)."""
        deltas = tuple(deltas)
        d = deltas[0] if deltas else None
        for e, other in enumerate(deltas):
            if (other.base_shape, other.rank, other.dtype, other._alpha_factor) != \
                    (d.base_shape, d.rank, d.dtype, d._alpha_factor) or other.scale is not d.scale:
                raise ValueError(f"expert {e} ({other!r}) differs from expert 0 ({d!r}) in shape, "
                                 f"rank, dtype, alpha factor or LoraScale")
        if d is None:
            raise ValueError("experts need at least one delta")
        self = cls.__new__(cls)
        self._set(deltas, d.alpha, d.rslora, d.dtype, d.scale, d._alpha_factor)
        return self

    def _build(self, a_bits, b_bits, name, alpha, rslora, factor, scale):
        """Each expert's packed C storage from the stored bits [E, rank, cols] / [E, rows, rank]."""
        n, rank, cols = a_bits.shape
        rows = b_bits.shape[1]
        code = dtypes.CODES[name]
        experts = []
        for e in range(n):
            ptr = lib.lora_delta_new(code, rank, rows, cols, from_buffer(a_bits[e]),
                                     from_buffer(b_bits[e]))
            if ptr == ffi.NULL:
                raise MemoryError(f"cannot allocate expert {e} of {n}: a rank-{rank} "
                                  f"[{rows} x {cols}] {name} delta")
            experts.append(LoraDelta._adopt(ptr, rank, rows, cols, alpha=alpha, rslora=rslora,
                                            dtype=name, scale=scale, alpha_factor=factor))
        self._set(tuple(experts), alpha, rslora, name, scale, factor)

    def _set(self, experts, alpha, rslora, name, scale, factor):
        d = experts[0]
        self._experts, self._n = experts, len(experts)
        self._rank, self._rows, self._cols = d.rank, d.rows, d.cols
        self._alpha, self._rslora, self._dtype = alpha, rslora, name
        self._scale, self._alpha_factor = scale, factor
        self._xshape, self._oshape = (d.cols,), (d.rows,)
        self._table = EntryTable([self], "experts", routed=True)

    def _zero_alpha(self):
        """PEFT's alpha-0 rule (a zero delta; see `lora.delta.peft_delta`), set by the loaders
        before anything holds these experts."""
        self._alpha_factor = 0.0
        for d in self._experts:
            d._alpha_factor = 0.0
        self._table = EntryTable([self], "experts", routed=True)

    # ------------------------------------------------------------ properties
    n_experts = property(lambda self: self._n, doc="The number of experts E.")
    rank = property(lambda self: self._rank, doc="The LoRA rank r (one for every expert).")
    rows = property(lambda self: self._rows, doc="n_out of one expert.")
    cols = property(lambda self: self._cols, doc="n_in of one expert.")
    alpha = property(lambda self: self._alpha, doc="lora_alpha (0 = none: factor 1).")
    rslora = property(lambda self: self._rslora, doc="True when alpha is divided by sqrt(rank).")
    dtype = property(lambda self: self._dtype, doc='Storage dtype: "float32" | "float16" | "bfloat16".')
    scale = property(lambda self: self._scale, doc="The LoraScale every expert reads (shared).")
    alpha_factor = property(lambda self: self._alpha_factor,
                            doc="alpha / rank (/ sqrt(rank) with rslora; 1 at alpha 0).")
    base_shape = property(lambda self: (self._rows, self._cols),
                          doc="(rows, cols) of one expert's base.")
    expert_shape = property(lambda self: (self._n, self._rows, self._cols),
                            doc="(n_experts, rows, cols): the 3-D expert weight, [E, n_out, n_in].")

    @property
    def effective_scale(self):
        """``scale.value * alpha_factor``: the s of ``out += s * B_e (A_e x)`` right now."""
        return self._scale.value * self._alpha_factor

    @property
    def resident_bytes(self):
        """n_experts * rank * (rows + cols) * itemsize (logical; padding not counted)."""
        return self._n * self._rank * (self._rows + self._cols) * dtypes.ITEMSIZE[self._dtype]

    def __repr__(self):
        return (f"LoraExperts(n_experts={self._n}, rank={self._rank}, rows={self._rows}, "
                f"cols={self._cols}, alpha={self._alpha}, dtype={self._dtype!r}, "
                f"scale={self._scale.value})")

    def expert(self, e):
        """Expert ``e`` alone: a `LoraDelta` sharing this object's storage and LoraScale.
        ``e`` an int in ``[0, n_experts)`` (TypeError / IndexError otherwise)."""
        if isinstance(e, (bool, np.bool_)):
            raise TypeError(f"an expert id must be an integer; got {e!r}")
        try:
            e = operator.index(e)
        except TypeError:
            raise TypeError(f"an expert id must be an integer; got {e!r}") from None
        if not 0 <= e < self._n:
            raise IndexError(f"expert id {e} is out of range [0, {self._n})")
        return self._experts[e]

    def _kernel_entries(self):
        """The entry protocol (lora._entries): one kernel entry per expert, in expert order."""
        s, f = self._scale, self._alpha_factor
        return tuple((Member(d._ptr, s, f, self),) for d in self._experts)

    # ------------------------------------------------------------ pickling, copies
    def lora_weights(self):
        """(lora_a [E, rank, cols], lora_b [E, rows, rank]) as stored, in the storage dtype."""
        got = [d.lora_weights() for d in self._experts]
        return np.stack([a for a, _ in got]), np.stack([b for _, b in got])

    def _parts(self):
        """By value (lora._byvalue): the stored bits, dtype, alpha, rsLoRA, factor, LoraScale."""
        a, b = self.lora_weights()
        bits = dtypes.BY_NAME[self._dtype].bits
        return _restore, (a.view(bits), b.view(bits), self._dtype, self._alpha, self._rslora,
                          self._alpha_factor, self._scale)

    def _shallow(self):  # the same experts' storage and LoraScale
        new = type(self).__new__(type(self))
        new._set(self._experts, self._alpha, self._rslora, self._dtype, self._scale,
                 self._alpha_factor)
        return new

    # ------------------------------------------------------------ apply
    def add_to(self, x, out, expert_ids):
        """``out[..., j, :] += s * B_e (A_e x_j)`` with ``e = expert_ids[..., j]``; returns out.

        ``expert_ids``: integers of any shape ``[..., k]`` (at least 1-D; NumPy, a CPU torch
        tensor or an array-like); ``-1`` leaves a slot untouched; any other id outside
        ``[0, n_experts)`` (the expert-parallel sentinel ``n_experts`` included) is an IndexError
        naming the id and its position.  ``out``: ``expert_ids.shape + (rows,)``, float32,
        float16 or bfloat16, NumPy or a CPU torch tensor, C-contiguous or row-strided.  ``x``,
        any real float array, in one of two routing forms:

        - one row per token, shared by its ``k`` slots: ``x.shape == expert_ids.shape[:-1] +
          (cols,)`` (the gate / up projection: ``x [T, cols]`` with ids ``[T, k]``; ``x
          [cols]`` with ids ``[k]`` for one token);
        - one row per slot: ``x.shape == expert_ids.shape + (cols,)`` (the down projection
          ``[T, k, cols]``, or flattened, possibly expert-sorted rows ``[S, cols]`` with ids
          ``[S]``).

        Any other shape is a ValueError naming both shapes.  Each slot's row is bit-identical to
        ``expert(e).add_to(x_row, out_row)``, whatever the batch, the routing and the thread
        count.  Errors as `LoraDelta.add_batch_to`; ``out`` is untouched on every error.
        """
        return apply_experts(self._table, x, out, expert_ids)

    # ------------------------------------------------------------ offline
    def delta_weight(self):
        """``s * B_e @ A_e`` for every expert as a new float32 ``[n_experts, rows, cols]`` array
        (each computed in float64 by NumPy, rounded once)."""
        s = finite_scale(self.effective_scale)
        w = np.empty(self.expert_shape, np.float32)
        for e, d in enumerate(self._experts):
            w[e] = d._delta64(s)
        return w

    def merge_into(self, w):
        """``w[e] += s * B_e @ A_e`` for every expert, in place; returns ``w``.

        ``w``: the 3-D expert weight, float32, float16 or bfloat16, NumPy or a CPU torch tensor
        (a Parameter that requires grad is fine, as for `LoraDelta.merge_into`), either
        ``[n_experts, rows, cols]`` C-contiguous or the transposed view
        (``.transpose(-1, -2)``) of a C-contiguous ``[n_experts, cols, rows]`` array (experts
        stored ``[E, in, out]``, as GPT-OSS does).  Each sum is formed in float64 and rounded
        once to ``w``'s dtype; a result that would overflow it is a ValueError naming the expert,
        raised before any expert is written.  Scale 0 leaves ``w`` bit-identical."""
        return self._merge(w, 1.0)

    def unmerge_from(self, w):
        """``w[e] -= s * B_e @ A_e``; undoes ``merge_into`` within the rounding of ``w``'s dtype."""
        return self._merge(w, -1.0)

    def _merge(self, w, sign):
        views = self._expert_views(w)
        for write in (False, True):  # every expert checked before the first is written
            for e, (d, we) in enumerate(zip(self._experts, views)):
                try:
                    merge_(we, [(d, sign)], self._rows, self._cols, check=not write, write=write)
                except ValueError as exc:
                    raise ValueError(f"expert {e}: {exc}") from None
        return w

    def _expert_views(self, w):
        """w[e] for every expert, after the 3-D checks (each view is then checked as a base)."""
        want = self.expert_shape
        if not (isinstance(w, ndarray) or arrays.is_tensor(w)):
            raise TypeError(f"w must be a numpy.ndarray or a CPU torch.Tensor of float32, float16 "
                            f"or bfloat16 {list(want)}; got {type(w).__name__}")
        if arrays.is_tensor(w):
            arrays.check_tensor_place(w, "w")
        shape = tuple(w.shape)
        if shape != want:
            hint = ""
            if shape == (want[0], want[2], want[1]):
                hint = (" (experts stored [n_experts, in, out]: pass w.transpose(-1, -2), the "
                        "[n_experts, out, in] view)")
            raise ValueError(f"w must have shape {want} = [n_experts, rows, cols]; got "
                             f"{shape}{hint}")
        if arrays.is_tensor(w):
            ok = w.is_contiguous() or w.transpose(-1, -2).is_contiguous()
            strides = tuple(w.stride())
        else:
            ok = w.flags.c_contiguous or w.transpose(0, 2, 1).flags.c_contiguous
            strides = w.strides
        if not ok:
            raise ValueError(f"w must be C-contiguous [n_experts, rows, cols], or the transposed "
                             f"view (.transpose(-1, -2)) of a C-contiguous [n_experts, cols, "
                             f"rows] array; got strides {strides}")
        return [w[e] for e in range(self._n)]


# --------------------------------------------------------------------------------------------
# the checked path, shared by LoraExperts.add_to and the banks of experts
# --------------------------------------------------------------------------------------------


def apply_experts(table, x, out, expert_ids, adapter_ids=None, scales=None):
    """The routed add through ``table`` (a routed EntryTable of experts entries): the checks of
    `LoraExperts.add_to` (and, for a bank, of its adapter ids and scales), then one
    ``lora_apply_experts`` call through `lora._dispatch.run_batch`.  Returns out."""
    if table.stale:
        table._rebuild()
    if scales is None and table._expert_shape is not None and \
            _fast(table, x, out, expert_ids, adapter_ids) == 0:
        return out
    ids, idp = _expert_ids(expert_ids, table._expert_shape)
    ishape = tuple(ids.shape)
    if not ishape:
        raise ValueError("expert_ids must have at least one axis ([..., k]); got a 0-d id")
    if not (isinstance(x, ndarray) or arrays.is_tensor(x)):
        x = arrays.float_array(x, "x")
    eshape = table._expert_shape
    cols = eshape[2] if eshape is not None else (x.shape[-1] if x.shape else 0)
    xnd = len(x.shape)
    if xnd == len(ishape):
        xdrop, xshape = 1, ishape[:-1] + (cols,)
    elif xnd == len(ishape) + 1:
        xdrop, xshape = 0, ishape + (cols,)
    else:
        xdrop, xshape = None, None
    if xshape is None or tuple(x.shape) != xshape:
        raise ValueError(
            f"x has shape {tuple(x.shape)}; with expert_ids of shape {ishape} it must be "
            f"{ishape[:-1] + (cols,)} (one row per token, shared by its {ishape[-1]} slots) or "
            f"{ishape + (cols,)} (one row per slot)")
    if (isinstance(out, ndarray) or arrays.is_tensor(out)) and (
            tuple(out.shape[:-1]) != ishape or len(out.shape) != len(ishape) + 1
            or eshape is not None and out.shape[-1] != eshape[1]):
        rows = eshape[1] if eshape is not None else "rows"
        raise ValueError(f"out must have shape {ishape + (rows,)} = expert_ids.shape + (rows,) "
                         f"for expert_ids of shape {ishape}; got {tuple(out.shape)}")
    aids, aidp, pos, posp, every = None, NULL, None, NULL, 1
    if adapter_ids is not None:
        aids, aidp, pos, posp, every = _bank_ids(adapter_ids, scales, ishape, table.n_entries)
    if eshape is None:  # no entry holds experts: check what can be checked, add nothing
        return _shapeless(table, x, out, ids, aids, pos)
    extra = (table, ids, idp, ishape[-1] if xdrop else 1, aids, aidp, pos, posp, every)
    return run_batch(_call, None, extra, x, out, cols, eshape[1], None, xdrop)


def _call(extra, lead, n, xp, xc, ldx, op, oc, ldo):
    """`apply_experts`'s C call in the dispatch's form (see lora._dispatch)."""
    table, ids, idp, x_every, aids, aidp, pos, posp, every = extra
    if not n:
        return 0
    n_experts, rows, cols = table._expert_shape
    bad = ffi.new("int64_t *")
    status = _apply(table.n_kernel, table.first, table.ptrs, table.scales(), table.n_entries,
                    table.starts_c, n_experts, aidp, posp, every, idp, x_every, rows, cols, n, xp,
                    xc, ldx, op, oc, ldo, bad)
    if status and status != ERR_ALIGN:
        _raise(status, table, ids, aids, pos, bad)
    return status


def _fast(table, x, out, expert_ids, adapter_ids):
    """The fast path of `apply_experts` (the banks, and tensors under `accelerate_peft`): x and
    out both NumPy arrays or both plain CPU tensors, C-contiguous, of the routed shapes; int64
    expert ids of the same kind; adapter ids None or int64 (a tensor or an ndarray) of the
    per-token or per-slot shape; no scales.  Returns the C status (any refusal is made again
    by the checked path, which names it: nothing was written), or None when the arguments are
    not of that form."""
    try:
        if type(out) is ndarray:
            if type(x) is not ndarray or type(expert_ids) is not ndarray \
                    or expert_ids.dtype is not _I64:
                return None
            xc, oc = fast_code(id(x.dtype)), fast_code(id(out.dtype))
        else:
            codes = _TORCH_CODES if _TORCH_INT64[0] is not None else _torch_init()
            xc, oc = codes.get(x.dtype), codes.get(out.dtype)
            if expert_ids.dtype is not _TORCH_INT64[0]:
                return None
        if xc is None or oc is None:
            return None
        n_experts, rows, cols = table._expert_shape
        ish, os_, xs = expert_ids.shape, out.shape, x.shape
        nd = len(ish)
        if not nd or len(os_) != nd + 1 or os_[-1] != rows or os_[:-1] != ish or xs[-1] != cols:
            return None
        if len(xs) == nd and xs[:-1] == ish[:-1]:
            x_every = ish[-1]
        elif len(xs) == nd + 1 and xs[:-1] == ish:
            x_every = 1
        else:
            return None
        aidp, every = NULL, 1
        if adapter_ids is not None:
            ash = adapter_ids.shape
            every = ish[-1] if ash == ish[:-1] else (1 if ash == ish else 0)
            if not every:
                return None
            if type(adapter_ids) is ndarray:
                if adapter_ids.dtype is not _I64:
                    return None
                aidp = from_buffer(INT64S, adapter_ids)  # ValueError: not contiguous
            elif (adapter_ids.dtype is _TORCH_INT64[0] and adapter_ids.is_cpu
                  and adapter_ids.is_contiguous() and not adapter_ids.is_neg()):
                aidp = _cast(_INT64P, adapter_ids.data_ptr())
            else:
                return None
        if type(out) is ndarray:
            n = expert_ids.size
            xp, op = from_buffer(x), from_buffer(CHARS, out, True)  # ValueError: see above
            idp = from_buffer(INT64S, expert_ids)
        else:
            n = out.numel() // rows
            if not (x.is_cpu and out.is_cpu and expert_ids.is_cpu and not out.requires_grad
                    and x.is_contiguous() and out.is_contiguous() and expert_ids.is_contiguous()
                    and not (x.is_neg() or out.is_neg() or expert_ids.is_neg())):
                return None
            _note_write(out)
            xp, op = _cast(_VOIDP, x.data_ptr()), _cast(_VOIDP, out.data_ptr())
            idp = _cast(_INT64P, expert_ids.data_ptr())
        if not n:
            return None
    except _TENSOR_MISS + (ValueError,):
        return None
    return _apply(table.n_kernel, table.first, table.ptrs, table.scales(), table.n_entries,
                  table.starts_c, n_experts, aidp, NULL, every, idp, x_every, rows, cols, n, xp,
                  xc, cols, op, oc, rows, NULL)


def _expert_ids(expert_ids, expert_shape=None):
    """(ids, C pointer): an int64 CPU tensor that is contiguous is read in place, anything else
    becomes an int64 C-contiguous NumPy array (bool and float ids: TypeError)."""
    if arrays.is_tensor(expert_ids):
        arrays.check_tensor_place(expert_ids, "expert_ids")
        torch = arrays.torch_module()
        if (expert_ids.dtype == torch.int64 and expert_ids.is_contiguous()
                and not expert_ids.is_neg()):
            return expert_ids, _cast(_INT64P, expert_ids.data_ptr())
    ids = arrays.as_ids(expert_ids, "expert_ids", any_shape=True,
                        bound=expert_shape[0] if expert_shape is not None else None)
    return ids, from_buffer(INT64S, ids)


def _bank_ids(adapter_ids, scales, ishape, n_entries):
    """A bank's adapter ids (and scales): per token (``ishape[:-1]`` or a prefix of it) or per
    slot (``ishape``).  Returns (ids, ptr, scales, ptr, slots per id)."""
    ids = arrays.as_ids(adapter_ids, "adapter_ids", any_shape=True, bound=n_entries)
    if ids.ndim == 0 and len(ishape) == 1:  # one token's k slots
        return with_scales(ids, scales, ishape[0])
    return with_scales(ids, scales, arrays.per_id_shape(ids, ishape, "adapter_ids"))


def _np_ids(ids):
    return ids if isinstance(ids, ndarray) else np.asarray(ids.detach().cpu())


def _raise(status, table, ids, aids, pos, bad):
    """The exception for a nonzero status of ``lora_apply_experts``."""
    at = int(bad[0])
    if status == _ERR_INDEX:
        ids = _np_ids(ids)
        v = int(ids.reshape(-1)[at])
        if table._expert_shape is None:
            valid, hint = "-1 (no expert) and ids >= 0", ""
        else:
            n = table._expert_shape[0]
            valid = f"-1 (no expert) and 0..{n - 1}"
            hint = (" (n_experts is the expert-parallel sentinel: mask such slots to -1)"
                    if v == n else "")
        raise IndexError(f"expert id {v} at position {arrays.position_of(ids, at)} is out of "
                         f"range: valid ids are {valid}{hint}")
    if status == _ERR_ADAPTER:
        arrays.raise_status(status, adapter_ids=aids, n_entries=table.n_entries, bad=bad)
    arrays.raise_status(status, bad=bad, scales=pos)


def _shapeless(table, x, out, ids, aids, pos):
    """A table none of whose entries holds experts: out and x checked as arrays, the ids
    checked as far as they can be (no expert count: only -1 and up), nothing added."""
    if not (isinstance(out, ndarray) or arrays.is_tensor(out)) or len(out.shape) < 2:
        arrays.batched_shape(out, "rows", "out")  # raises
    arrays.check_out(out, tuple(out.shape), batched=True)
    if arrays.is_tensor(x):
        arrays.check_tensor_place(x, "x")
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a real floating array; got dtype {arrays.dtype_name(x)}")
    arrays.no_overlap(x, out)
    flat = _np_ids(ids).reshape(-1)
    wrong = np.flatnonzero(flat < -1)
    if wrong.size:
        _raise(_ERR_INDEX, table, ids, None, None, ffi.new("int64_t *", int(wrong[0])))
    if aids is not None:
        af = aids.reshape(-1)
        wrong = np.flatnonzero((af < -1) | (af >= table.n_entries))
        if wrong.size:
            _raise(_ERR_ADAPTER, table, ids, aids, pos, ffi.new("int64_t *", int(wrong[0])))
    return out
