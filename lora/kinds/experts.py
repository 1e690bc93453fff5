"""`LoraExperts`: LoRA on the routed experts of a mixture-of-experts layer.

A MoE layer holds ``n_experts`` expert matrices in one 3-D weight and routes each token to ``k``
of them.  Expert LoRA (PEFT ``target_parameters``, llama.cpp ``build_lora_mm_id``) gives expert
``e`` its own pair ``(A_e, B_e)`` and adds ``s * B_e (A_e x)`` for the (token, expert) pairs the
router chose only.  Layouts: ``a [n_experts, rank, cols]``, ``b [n_experts, rows, rank]``, one
expert's base ``[rows, cols] = [n_out, n_in]``.

One C call per `LoraExperts.add_to` (the routed op of ``lora_apply``): the pairs are grouped by
expert (the bank's counting sort), each expert's factors stream once per block of pairs, and
every pair's row is bit-identical to ``expert(e).add_to`` on it alone.  The experts are a routed
entry table (one kernel entry per expert), applied as every table is (`lora._apply`); a bank of
experts (`LoraBank.add_experts_to`, ``AdapterSet.bank``) is the same table with adapter ids.
"""

import operator

import numpy as np

from .. import _arrays as arrays
from .. import _torch as torchs
from .. import _formats as formats
from .._byvalue import ByValue
from .._entries import EntryTable, Member, entry_type
from .._lora_cffi import ffi, lib
from .._merge import finite_scale, merge_
from .delta import LoraDelta, alpha_factor, check_alpha, check_bits
from ..errors import LoraShapeError
from ..scale import LoraScale

__all__ = ["LoraExperts"]


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


def _restore(a_bits, b_bits, dtype, alpha, rslora, factor, scale, dims=None):
    """Unpickling: experts from their stored bits (see `LoraExperts._parts`)."""
    return LoraExperts._from_bits(a_bits, b_bits, dtype, alpha, rslora, factor, scale, dims)


@entry_type
class LoraExperts(ByValue):
    """LoRA on ``n_experts`` routed experts: adds ``s * B_e (A_e x)`` for the routed pairs only.

    ``LoraExperts(a, b, *, alpha=0.0, scale=1.0, rslora=False, dtype="float32")``

    - ``a``: ``[n_experts, rank, cols]``, ``b``: ``[n_experts, rows, rank]``: expert ``e``'s pair
      is ``(a[e], b[e])`` in `LoraDelta`'s layout; any real float array-like, copied into owned
      storage of ``dtype`` ("float32" | "float16" | "bfloat16", rounded to nearest even, or
      "q8_0": each expert's factors quantized as `LoraDelta` quantizes them).
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
                 "_scale", "_alpha_factor", "_table", "__weakref__")

    def __init__(self, a, b, *, alpha=0.0, scale=1.0, rslora=False, dtype="float32"):
        a = arrays.float_array(a, "lora_a")
        b = arrays.float_array(b, "lora_b")
        if (a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]
                or 0 in a.shape or 0 in b.shape):
            raise _pair_error(a, b)
        names = formats.pair_names(dtype)
        alpha = check_alpha(alpha, rslora)
        if not isinstance(scale, LoraScale):
            scale = LoraScale(scale)
        fa, fb = (formats.BY_NAME[n] for n in names)
        a_bits, b_bits = fa.store(a, "lora_a"), fb.store_b(b, "lora_b")
        self._build(a_bits, b_bits, names, alpha, bool(rslora),
                    alpha_factor(alpha, a.shape[1], bool(rslora)), scale,
                    (a.shape[1], b.shape[1], a.shape[2]))

    @classmethod
    def _of(cls, a, b, *, alpha=0.0, scale=1.0, rslora=False, dtype="float32"):
        """Experts whose lora_a is a `lora._formats.Stored` ``[E, rank, cols]`` kept as it is (a
        GGUF file's Q8_0 lora_a), lora_b values stored in B's format of ``dtype``
        (package-internal: the loaders)."""
        b = arrays.float_array(b, "lora_b")
        n, rank, cols = a.shape
        if b.ndim != 3 or b.shape[0] != n or b.shape[2] != rank or b.shape[1] < 1:
            raise LoraShapeError(f"LoRA experts do not pair: lora_a {a.shape}, lora_b {b.shape}",
                                 rank=rank, cols=cols, a_len=n * rank * cols, b_len=b.size)
        alpha = check_alpha(alpha, rslora)
        if not isinstance(scale, LoraScale):
            scale = LoraScale(scale)
        fb = formats.BY_NAME[formats.pair_names(dtype)[1]]
        self = cls.__new__(cls)
        self._build(a.bits, fb.store_b(b, "lora_b"), (a.format.name, fb.name), alpha,
                    bool(rslora), alpha_factor(alpha, rank, bool(rslora)), scale,
                    (rank, b.shape[1], cols))
        return self

    @classmethod
    def _from_bits(cls, a_bits, b_bits, dtype, alpha, rslora, factor, scale, dims=None):
        a_bits, b_bits, dims = check_bits(a_bits, b_bits, dtype, a_ndim=3, dims=dims)
        if not isinstance(scale, LoraScale):
            raise TypeError(f"scale must be a LoraScale; got {type(scale).__name__}")
        self = cls.__new__(cls)
        self._build(a_bits, b_bits, formats.pair_names(dtype), check_alpha(alpha, rslora),
                    bool(rslora), check_alpha(factor, False), scale, dims)
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

    def _build(self, a_bits, b_bits, names, alpha, rslora, factor, scale, dims):
        """Each expert's packed C storage from the stored bits [E, ...] (`bits_shapes`) of a
        rank-``rank`` [rows x cols] pair, ``dims = (rank, rows, cols)``, formats ``names``."""
        n = a_bits.shape[0]
        rank, rows, cols = dims
        name = formats.pair_name(*names)
        ca, cb = (formats.BY_NAME[nm].code for nm in names)
        experts = []
        for e in range(n):
            ptr = lib.lora_delta_new(ca, cb, rank, rows, cols, ffi.from_buffer(a_bits[e]),
                                     ffi.from_buffer(b_bits[e]))
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
    dtype = property(lambda self: self._dtype, doc='Storage dtype: "float32" | "float16" | '
                     '"bfloat16" | "q8_0" (A\'s and B\'s where they differ: "q8_0/float32").')
    dtypes = property(lambda self: formats.pair_names(self._dtype),
                      doc="The storage dtypes of (A, B).")
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
        """n_experts * rank * (cols + rows) * itemsize (logical; padding not counted; q8_0: 34
        bytes per block, as `LoraDelta.resident_bytes`)."""
        return self._n * self._experts[0].resident_bytes

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
        """(lora_a [E, rank, cols], lora_b [E, rows, rank]) as stored, in the storage dtype (q8_0:
        float32 holding the dequantized values, as `LoraDelta.lora_weights`)."""
        got = [d.lora_weights() for d in self._experts]
        return np.stack([a for a, _ in got]), np.stack([b for _, b in got])

    def _parts(self):
        """By value (lora._byvalue): the stored bits, dtype, alpha, rsLoRA, factor, LoraScale
        and the dimensions."""
        got = [d._stored_bits() for d in self._experts]
        return _restore, (np.stack([a for a, _ in got]), np.stack([b for _, b in got]),
                          self._dtype, self._alpha, self._rslora, self._alpha_factor, self._scale,
                          (self._rank, self._rows, self._cols))

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
        return self._table.apply_experts(x, out, expert_ids)

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
        if not (isinstance(w, np.ndarray) or torchs.is_tensor(w)):
            raise TypeError(f"w must be a numpy.ndarray or a CPU torch.Tensor of float32, float16 "
                            f"or bfloat16 {list(want)}; got {type(w).__name__}")
        if torchs.is_tensor(w):
            torchs.check_tensor_place(w, "w")
        shape = tuple(w.shape)
        if shape != want:
            hint = ""
            if shape == (want[0], want[2], want[1]):
                hint = (" (experts stored [n_experts, in, out]: pass w.transpose(-1, -2), the "
                        "[n_experts, out, in] view)")
            raise ValueError(f"w must have shape {want} = [n_experts, rows, cols]; got "
                             f"{shape}{hint}")
        if torchs.is_tensor(w):
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
