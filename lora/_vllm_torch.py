"""lora.vllm's grouped torch path: what serves a call the kernels cannot read (another device,
dtype or layout), correctly: per slot (and expert) in the batch, its rows through float32 matmuls,
rounded once into the output; a token with slot -1 is left untouched (vLLM's stock torch ops read
slot -1 as the last slot)."""

import torch

__all__ = ["slots_any", "zero_pairs", "torch_experts", "zero_rows", "torch_slice"]


def slots_any(t):
    """A stacked tensor as ``[slots, n, m]`` for the torch path (any device or layout)."""
    if t is None:
        return None
    return t[:, 0] if t.dim() == 4 else t


def zero_pairs(y, ids, experts):
    """Zero ``y [T, k, n]`` at the (token, slot) pairs a LoRA serves (assign semantics)."""
    mask = (ids >= 0).unsqueeze(1) & (experts >= 0)
    y[mask] = 0


def torch_experts(out, x, a, b, ids, experts, scales):
    """The grouped torch path for expert LoRA: per (slot, expert) in the batch, its pairs'
    rows through float32 matmuls, rounded once into ``out [T, k, n]``."""
    T, k = experts.shape
    slot = ids.unsqueeze(1).expand(T, k)
    xs = x if x.dim() == 3 else x.unsqueeze(1).expand(T, k, x.shape[-1])
    for s, e in torch.unique(torch.stack([slot.reshape(-1), experts.reshape(-1)], 1),
                             dim=0).tolist():
        if s < 0 or e < 0:
            continue
        t, j = ((slot == s) & (experts == e)).nonzero(as_tuple=True)
        term = (xs[t, j].float() @ a[s, e].float().T) @ b[s, e].float().T
        if scales is not None:
            term = term * scales[t, j].unsqueeze(1).float()
        out[t, j] = (out[t, j].float() + term).to(out.dtype)


def zero_rows(out, ids):
    """Zero the rows of ``out`` a slot serves (the -1 rows keep their bits)."""
    if out.shape[0] == 0:
        return
    neg = ids < 0
    if not bool(neg.any()):
        out.zero_()
    else:
        out[~neg] = 0


def torch_slice(kind, out, x, a3, b3, ids, scale, assign):
    """The grouped torch path: per slot in the batch, its rows through float32 matmuls
    (``buffer = scale * x A^T``, ``t = buffer B^T``), rounded once into ``out``; -1 rows and
    rows of no slot untouched."""
    ids = ids.to(torch.long)
    for s in torch.unique(ids).tolist():
        if s < 0:
            continue
        rows = (ids == s).nonzero().squeeze(1)
        t = x.index_select(0, rows).float()
        if kind != "b":
            t = scale * (t @ a3[s].float().T)
        if kind != "a":
            t = t @ b3[s].float().T
        if not assign:
            t = out.index_select(0, rows).float() + t
        out.index_copy_(0, rows, t.to(out.dtype))
