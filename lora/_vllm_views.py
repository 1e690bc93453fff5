"""What lora.vllm's kernels read of vLLM's tensors: banks of `LoraDelta` views over one layer's
stacked slot tensors (no copy), kept while the tensors' data pointers, shapes and version counters
hold, and the checks that say when the kernels cannot read them (then the grouped torch path of
`lora._vllm_torch` serves the call)."""

import torch

from . import _dtypes as dtypes
from .kinds.bank import LoraBank
from .kinds.delta import LoraDelta
from .kinds.experts import LoraExperts
from .scale import LoraScale

__all__ = ["Views", "ExpertViews", "slots_key", "cannot_experts", "ACT", "TRIM_RANK"]

ACT = (torch.float32, torch.bfloat16, torch.float16)  # the activation dtypes the kernels take

# Skip the zero-padded ranks of a slot (vLLM pads every adapter to max_lora_rank): the
# package-internal switch the benchmark turns off to measure what the padding costs
TRIM_RANK = True


def _storage(t):
    """The lora-kernels storage dtype name of a torch tensor's dtype, or None."""
    return dtypes.NAME_OF.get(dtypes.torch_codes().get(t.dtype))


class _Identity:
    """Identity matrices of one storage dtype and size, kept per (dtype, n): the other factor
    of a shrink alone (``B = I``) or an expand alone (``A = I``), which is exact."""

    _cache = {}

    @classmethod
    def get(cls, torch_dtype, n):
        key = (torch_dtype, n)
        eye = cls._cache.get(key)
        if eye is None:
            eye = cls._cache[key] = torch.eye(n, dtype=torch_dtype)
        return eye


def _ranks(a, b):
    """Per slot, the rank that carries weight: the last k with A[k] and B[:, k] both nonzero, + 1
    (vLLM zero-pads each adapter to max_lora_rank); a slot of zeros gets 0.  ``a`` [S, r, in],
    ``b`` [S, out, r]; None stands for an identity factor."""
    nz = None
    if a is not None:
        nz = a.abs().amax(dim=2) != 0                      # [S, r]
    if b is not None:
        nzb = b.abs().amax(dim=1) != 0                     # [S, r]
        nz = nzb if nz is None else nz & nzb
    r = nz.shape[1]
    idx = torch.arange(1, r + 1).expand_as(nz)
    return (idx * nz).amax(dim=1).tolist()


class Views:
    """A `LoraBank` over one layer's stacked slot tensors, one entry per slot, each a
    `LoraDelta` view of the slot's memory (no copy).  ``kind``: "ab" (A and B: a whole LoRA
    term), "a" (A with B = I: a shrink into the rank buffer), "b" (A = I, B: an expand).  Kept
    while the tensors' data pointers, shapes and version counters are unchanged: vLLM writes
    a new adapter into a slot in place (which bumps the version), so the next call rebuilds.
    ``bank`` is None and ``why`` says why when the kernels cannot read the tensors."""

    __slots__ = ("key", "bank", "why", "keep")

    def __init__(self, kind, a, b):
        self.key = slots_key(a, b)
        self.bank, self.keep = None, (a, b)
        a3 = None if a is None else _slots3(a)
        b3 = None if b is None else _slots3(b)
        self.why = _cannot(a, b, a3, b3)
        if self.why is not None:
            return
        r_max = a3.shape[1] if a3 is not None else b3.shape[2]
        slots = (a3 if a3 is not None else b3).shape[0]
        ranks = _ranks(a3, b3) if TRIM_RANK else [r_max] * slots
        one = (a3 if a3 is not None else b3).dtype
        name = _storage(a3 if a3 is not None else b3)
        entries = []
        try:
            for s, rank in enumerate(ranks):
                if rank == 0:
                    entries.append(None)          # an empty slot adds nothing
                    continue
                if kind == "ab":
                    sa, sb = a3[s], b3[s]
                elif kind == "a":
                    sa, sb = a3[s], _Identity.get(one, r_max)
                else:
                    sa, sb = _Identity.get(one, r_max), b3[s]
                entries.append(_view(sa, sb, name, rank))
            self.bank = LoraBank(entries)
        except (TypeError, ValueError) as exc:   # a layout the views refuse: the torch path
            self.why = f"{type(exc).__name__}: {exc}"


_ONE = LoraScale(1.0)   # vLLM folds alpha/r into B; a call's own `scale` goes per position


class ExpertViews:
    """A `LoraBank` of `LoraExperts` over one MoE layer's stacked expert slots (``a``
    ``[slots, E, r_max, in]``, ``b`` ``[slots, E, out, r_max]``), one entry per slot, each
    expert a `LoraDelta` view of its memory; kept and rebuilt as `Views`."""

    __slots__ = ("key", "bank", "keep")

    def __init__(self, a4, b4):
        self.key = slots_key(a4, b4)
        name = _storage(a4)
        entries = []
        for s in range(a4.shape[0]):
            ranks = _ranks(a4[s], b4[s]) if TRIM_RANK else [a4.shape[2]]
            rank = max(ranks)
            if rank == 0:
                entries.append(None)
                continue
            entries.append(LoraExperts._from_deltas(
                [_view(a4[s, e], b4[s, e], name, rank) for e in range(a4.shape[1])]))
        self.bank = LoraBank(entries)
        self.keep = (a4, b4)


def _view(a, b, name, rank):
    """A `LoraDelta` over ``a [r_max, cols]`` and ``b [rows, r_max]`` where they are (rows of
    any stride), using their first ``rank`` ranks (the rest: vLLM's zero padding)."""
    return LoraDelta.view((a.data_ptr(), a.stride(0)), (b.data_ptr(), b.stride(0)), dtype=name,
                          rank=rank, rows=b.shape[0], cols=a.shape[1], b_by_row=True,
                          scale=_ONE, keep=(a, b))


def slots_key(a, b):
    """What a kept bank of views depends on: each tensor's data pointer, version counter (vLLM's
    in-place slot writes bump it), shape and dtype."""
    return (None if a is None else (a.data_ptr(), a._version, a.shape, a.dtype),
            None if b is None else (b.data_ptr(), b._version, b.shape, b.dtype))


def _slots3(t):
    """vLLM's stacked tensor ``[slots, 1, n, m]`` (or ``[slots, n, m]``) as ``[slots, n, m]``,
    or None when it is not a CPU tensor whose last axis is contiguous."""
    if t.dim() == 4 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 3 or not t.is_cpu or (t.stride(2) != 1 and t.shape[2] > 1):
        return None
    return t


def _cannot(a, b, a3, b3):
    """Why the kernels cannot read these slot tensors (None: they can)."""
    if (a is not None and a3 is None) or (b is not None and b3 is None):
        return "a slot tensor is not [slots, 1, n, m] on the CPU with its last axis contiguous"
    for t in (a3, b3):
        if t is not None and _storage(t) is None:
            return f"the slot tensors are {t.dtype}, not float32, bfloat16 or float16"
    if a3 is not None and b3 is not None and (a3.dtype != b3.dtype or a3.shape[1] != b3.shape[2]
                                              or a3.shape[0] != b3.shape[0]):
        return f"lora_a {tuple(a3.shape)} {a3.dtype} and lora_b {tuple(b3.shape)} {b3.dtype} differ"
    return None


def cannot_experts(out, x, a, b):
    """Why the kernels cannot serve this expert slice (None: they can)."""
    for name, t in (("y", out), ("x", x)):
        if not t.is_cpu:
            return f"{name} is on {t.device}"
        if t.dtype not in ACT:
            return f"{name} is {t.dtype}"
    for name, t in (("lora_a", a), ("lora_b", b)):
        if t.dim() != 4 or not t.is_cpu or _storage(t) is None or \
                (t.stride(3) != 1 and t.shape[3] > 1):
            return f"{name} {tuple(t.shape)} {t.dtype} is not [slots, experts, n, m] on the CPU"
    if a.dtype != b.dtype or a.shape[:2] != b.shape[:2] or a.shape[2] != b.shape[3]:
        return f"lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} do not pair"
    if out.shape[-1] != b.shape[2] or x.shape[-1] != a.shape[3]:
        return (f"y's slice has {out.shape[-1]} columns and x {x.shape[-1]}; the experts are "
                f"[{b.shape[2]} x {a.shape[3]}]")
    return None
