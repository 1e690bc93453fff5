"""The one way every apply method reaches the kernels: the edge first, the checked path second.

Every adapter kind applies through a *target*: a `LoraDelta` (a table of one entry of one
member) or an entry table (`lora._entries.EntryTable`: stacks, banks, adapter-set banks, DoRA
deltas, experts).  A method hands the arguments it was given, as they are, to `lora._edge.apply`
(csrc/python/edge.c), which takes the complete case the kernels read in place in C and answers
0.  Anything else (a declined call, or a refusal of the C layer, after which nothing was
written) comes to `checked` here, which applies every rule of the input contract, raising
the precise error or converting what it may (an x the kernels cannot read in place becomes a
float32 copy; ids become int64, scales float64), and then calls the edge again with what it
made.  Nothing lies between the two: no second copy of the fast case.

A target provides ``base_shape`` ``(rows, cols)`` (None while a table holds no delta),
``expert_shape``, ``n_entries``, ``edge_view()`` (the edge's view of its C table, or None) and
``edge_scales()`` (a one-member target's effective scale as a float, or a table's scales and
epilogue data), ``epi_arg(op, ids, scales, n)`` (None, or the epilogue data of a call with
per-position scales; it also raises for an op the target's epilogues do not serve) and
``shapeless(...)`` (the checks a table without deltas can still make).
"""

import numpy as np

from . import _arrays as arrays
from . import _status
from . import _torch as torchs
from . import _dtypes as dtypes
from . import _edge
from ._lora_cffi import ffi, lib

__all__ = ["OP_VEC", "OP_BATCH", "OP_ROW", "OP_ROWS", "OP_EXPERTS", "checked", "rows_args",
           "address"]

OP_VEC, OP_BATCH, OP_ROW, OP_ROWS, OP_EXPERTS = (_edge.OP_VEC, _edge.OP_BATCH, _edge.OP_ROW,
                                                 _edge.OP_ROWS, _edge.OP_EXPERTS)
DECLINE = _edge.DECLINE
_edge_apply = _edge.apply
_ndarray = np.ndarray


def address(cdata):
    """A cffi pointer's address as an int: the form lora._edge takes pointers in."""
    return int(ffi.cast("uintptr_t", cdata))


# lora._edge reads NumPy's dtype objects (the activation dtypes, and the ids' and scales') and
# calls the library's own lora_apply (one library state: the ISA choice, the team, the plans)
_edge.setup(np.ndarray, dtypes.fast_pairs(), np.dtype(np.int64), np.dtype(np.float64),
            address(ffi.addressof(lib, "lora_apply")))


def checked(target, op, x, out, ids=None, scales=None, extra=None):
    """The checked path of one call (see the module docstring); returns out."""
    shape = target.base_shape
    if op == OP_EXPERTS:
        return _experts(target, x, out, extra, ids, scales)
    if shape is None:
        return target.shapeless(op, x, out, ids, scales)
    rows, cols = shape
    idn = posn = tok = None
    if op == OP_VEC:
        arrays.check_out(out, (rows,))
        x = arrays.check_x(x, out, (cols,))[0]
        n = 1
    elif op == OP_BATCH:
        target.plain("add_batch_to")
        bshape = arrays.batched_shape(out, rows, "out")
        _, _, n, _ = arrays.check_out(out, bshape, shown=f"(..., {rows})", batched=True)
        lead = bshape[:-1]
        x = arrays.check_x(x, out, lead + (cols,), batched=True, lead_of=bshape)[0]
        idn, posn = bank_ids(ids, scales, lead, target.n_entries)
    elif op == OP_ROW:
        x = arrays.token_id(x, rows)
        arrays.check_out(out, (cols,), "out_row")
        n = 1
    else:  # OP_ROWS
        target.plain("add_rows_to")
        x, n = rows_args(x, out, cols, rows)
        tok = x
        idn, posn = bank_ids(ids, scales, x.shape, target.n_entries)
    epi = target.epi_arg(op, idn, posn, n)
    if not n:
        return out
    st = _edge_apply(target.edge_view(), target.edge_scales(), op, x, arrays.canonical(out), idn,
                     posn, None, epi)
    if st == 0:
        return out
    if st == DECLINE:  # pragma: no cover - what the checks made is what the edge takes
        raise RuntimeError("lora-kernels: the checked arguments of a call were declined by the "
                           "C edge; please report this with the shapes and dtypes used")
    status, bad = st
    _status.raise_status(status, ids=tok if tok is not None else np.array([x]),
                        adapter_ids=idn, n_entries=target.n_entries, rows=rows, bad=[bad],
                        scales=posn)
    return out  # pragma: no cover - raise_status raises


def bank_ids(ids, scales, lead, n_entries):
    """A bank call's adapter ids (int64, of the leading shape `lead` or a prefix of it) and
    scales (float64, the ids' shape); (None, None) without ids.  `n_entries` names the valid
    range of an id past int64."""
    if ids is None:
        return None, None
    idn = arrays.as_ids(ids, "adapter_ids", any_shape=True, bound=n_entries)
    if len(lead) == 1 and idn.ndim == 1 and idn.shape[0] != lead[0]:
        raise ValueError(f"adapter_ids has {idn.shape[0]} ids; out has {lead[0]} positions")
    arrays.per_id_shape(idn, lead, "adapter_ids")
    return idn, _scales_of(scales, idn)


def _scales_of(scales, idn):
    if scales is None:
        return None
    pos = arrays.as_scales(scales)
    if pos.shape != idn.shape:
        raise ValueError(f"scales must have the shape of adapter_ids, {idn.shape}; got "
                         f"{pos.shape}")
    return pos


def rows_args(ids, out, cols, rows=None):
    """The checks of the gathers: ids of any shape (at least 1-D), out [*ids.shape, cols];
    `rows` (the vocabulary) names the valid range of an id past int64.  Returns (int64 ids,
    positions)."""
    if not (isinstance(out, _ndarray) or torchs.is_tensor(out)):
        arrays.check_out(out, None, shown=f"(n, {cols})")  # always raises: not an array
    if torchs.is_tensor(out):
        torchs.check_tensor_place(out, "out")  # device, layout, nested: before any shape is read
    tok = arrays.as_ids(ids, "ids", any_shape=True, bound=rows)
    if tok.ndim == 0:
        raise ValueError("ids must have at least one axis (a 0-d id is add_row_to's); got a "
                         "0-d array")
    if len(out.shape) >= 1 and tuple(out.shape[:-1]) != tok.shape and tok.ndim == 1 \
            and len(out.shape) == 2 and out.shape[-1] == cols:
        raise ValueError(f"ids has {tok.shape[0]} ids; out has {out.shape[0]} positions")
    _, _, n, _ = arrays.check_out(out, tok.shape + (cols,), shown=f"{tok.shape + (cols,)}",
                                  batched=True)
    return tok, n


# --------------------------------------------------------------------- experts


def _experts(target, x, out, expert_ids, adapter_ids, scales):
    """The routed add's checks (a LoraExperts, or a bank of them): x one row per token or per
    slot, out ``expert_ids.shape + (rows,)``, the expert ids, a bank's adapter ids per token
    or per slot; then the edge."""
    eids = _expert_ids(expert_ids, target.expert_shape)
    ishape = tuple(eids.shape)
    if not ishape:
        raise ValueError("expert_ids must have at least one axis ([..., k]); got a 0-d id")
    if not (isinstance(x, _ndarray) or torchs.is_tensor(x)):
        x = arrays.float_array(x, "x")
    eshape = target.expert_shape
    cols = eshape[2] if eshape is not None else (x.shape[-1] if x.shape else 0)
    xnd = len(x.shape)
    if xnd == len(ishape):
        xshape = ishape[:-1] + (cols,)
    elif xnd == len(ishape) + 1:
        xshape = ishape + (cols,)
    else:
        xshape = None
    if xshape is None or tuple(x.shape) != xshape:
        raise ValueError(
            f"x has shape {tuple(x.shape)}; with expert_ids of shape {ishape} it must be "
            f"{ishape[:-1] + (cols,)} (one row per token, shared by its {ishape[-1]} slots) or "
            f"{ishape + (cols,)} (one row per slot)")
    if (isinstance(out, _ndarray) or torchs.is_tensor(out)) and (
            tuple(out.shape[:-1]) != ishape or len(out.shape) != len(ishape) + 1
            or eshape is not None and out.shape[-1] != eshape[1]):
        rows = eshape[1] if eshape is not None else "rows"
        raise ValueError(f"out must have shape {ishape + (rows,)} = expert_ids.shape + (rows,) "
                         f"for expert_ids of shape {ishape}; got {tuple(out.shape)}")
    idn = posn = None
    if adapter_ids is not None:
        idn = arrays.as_ids(adapter_ids, "adapter_ids", any_shape=True, bound=target.n_entries)
        if not (idn.ndim == 0 and len(ishape) == 1):  # one token's k slots
            arrays.per_id_shape(idn, ishape, "adapter_ids")
        posn = _scales_of(scales, idn)
    if eshape is None:  # no entry holds experts: check what can be checked, add nothing
        return target.shapeless(OP_EXPERTS, x, out, idn, posn, eids)
    rows = eshape[1]
    oshape = arrays.batched_shape(out, rows, "out")
    _, _, n, _ = arrays.check_out(out, oshape, shown=f"(..., {rows})", batched=True)
    x = arrays.check_x(x, out, xshape, batched=True, lead_of=oshape)[0]
    if not n:
        return out
    st = _edge_apply(target.edge_view(), target.edge_scales(), OP_EXPERTS, x,
                     arrays.canonical(out), idn, posn, eids, None)
    if st == 0:
        return out
    if st == DECLINE:  # pragma: no cover - what the checks made is what the edge takes
        raise RuntimeError("lora-kernels: the checked arguments of a routed call were declined "
                           "by the C edge; please report this with the shapes and dtypes used")
    raise_experts(st[0], target, eids, idn, posn, st[1])
    return out  # pragma: no cover


def _expert_ids(expert_ids, expert_shape=None):
    """Expert ids as the edge reads them: an int64 CPU tensor that is contiguous as it is,
    anything else an int64 C-contiguous NumPy array (bool and float ids: TypeError)."""
    if torchs.is_tensor(expert_ids):
        torchs.check_tensor_place(expert_ids, "expert_ids")
        torch = torchs.torch_module()
        if (expert_ids.dtype == torch.int64 and expert_ids.is_contiguous()
                and not expert_ids.is_neg()):
            return expert_ids
    return arrays.as_ids(expert_ids, "expert_ids", any_shape=True,
                         bound=expert_shape[0] if expert_shape is not None else None)


def _np_ids(ids):
    return ids if isinstance(ids, _ndarray) else np.asarray(ids.detach().cpu())


def raise_experts(status, target, eids, idn, posn, bad):
    """The exception for a refusal of a routed call."""
    if status == _INDEX:
        ids = _np_ids(eids)
        v = int(ids.reshape(-1)[bad])
        if target.expert_shape is None:
            valid, hint = "-1 (no expert) and ids >= 0", ""
        else:
            n = target.expert_shape[0]
            valid = f"-1 (no expert) and 0..{n - 1}"
            hint = (" (n_experts is the expert-parallel sentinel: mask such slots to -1)"
                    if v == n else "")
        raise IndexError(f"expert id {v} at position {_status.position_of(ids, bad)} is out of "
                         f"range: valid ids are {valid}{hint}")
    _status.raise_status(status, adapter_ids=idn, n_entries=target.n_entries, bad=[bad],
                        scales=posn)


_INDEX = lib.LORA_ERR_INDEX

