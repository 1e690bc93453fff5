"""What every family shares: the row and build records, the skip signal, the context of a run,
the random operands, the float64 reference and the tolerances it is checked with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class Skip(Exception):
    """A workload this build or environment cannot run (not an error)."""


@dataclass
class Built:
    impls: dict  # name -> Impl; "ours" first
    bytes: int
    flops: int
    check: tuple = None  # (ours_fn, reference_fn, tolerance): each returns a fresh result array
    info: dict = None  # extra facts for the report (merged into the row's result)
    timing: dict = None  # TimingConfig fields this row sets for itself (e.g. more, shorter rounds)


@dataclass(eq=False)
class Workload:
    name: str
    group: str
    dtype: str
    build: object  # ctx -> Built; or, with `run`, None
    key: str = ""  # shape key shared by the float32 twin of a half-precision row
    result: dict = field(default_factory=dict)
    run: object = None  # (ctx, cfg, status, monitor) -> result dict: rows not timed by timing.measure


@dataclass
class Ctx:
    lora: object
    torch: object
    rng: object
    dram_reader: object = None  # Impl reading the DRAM-sized buffer once (or None)
    threads: int = 1
    cache: dict = field(default_factory=dict)


# relative-norm tolerance of the sanity check against float64 (half storage rounds A and B)
TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2, "q8_0": 3e-2}
# bytes per stored value: q8_0 keeps 34 bytes per block of 32 (a float16 scale, 32 int8 values)
VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "q8_0": 34 / 32}


def rand(rng, shape, amp):
    """float32 uniform in [-amp, amp)."""
    a = rng.random(shape, dtype=np.float32)
    a -= 0.5
    a *= 2 * amp
    return a


def pair(rng, rows, cols, rank):
    """A [rank, cols], B [rows, rank] with values of realistic size (|A x| ~ 1, |delta| ~ 1e-2)."""
    return rand(rng, (rank, cols), 1.7 / math.sqrt(cols)), rand(rng, (rows, rank), 0.02)


def make_delta(lora, a, b, dtype, rank):
    """A LoraDelta with effective scale 2 (alpha = 2*rank); Skip if this build lacks the dtype."""
    try:
        d = lora.LoraDelta(a, b, alpha=2.0 * rank, dtype=dtype)
    except (TypeError, ValueError, NotImplementedError) as e:
        if dtype != "float32":
            raise Skip(f"LoraDelta(dtype={dtype!r}) not supported by this build: {e}") from None
        raise
    return d


def scale_of(d):
    s = getattr(d, "effective_scale", None)
    return float(s) if s is not None else 2.0


def torch_dtype(torch, name):
    """The torch dtype of a storage dtype; None for q8_0 (torch has no such matmul operand: its
    rows have no torch baseline)."""
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(name)


def linear_model(rows, cols, ranks, n, w):
    """Bytes and flops of ``add_to`` / ``add_batch_to`` (batch n, 1 for decode) with deltas of
    `ranks` stored with itemsize w, float32 x and out:
    bytes = rank*(rows+cols)*w per delta + n*cols*4 (read x) + n*rows*4*2 (read and write out);
    flops = 2*n*rank*(rows+cols) per delta (A@x, then B@y; the scale is O(n*rank), not counted)."""
    nbytes = int(sum(r * (rows + cols) * w for r in ranks)) + n * cols * 4 + n * rows * 8
    flops = sum(2 * n * r * (rows + cols) for r in ranks)
    return nbytes, flops


def as64(a):
    """A NumPy array or a torch tensor (any dtype) as a float64 NumPy array."""
    return a.double().numpy() if hasattr(a, "double") else np.asarray(a, np.float64)


def lora_ref(a, b, s, x):
    """The float64 reference ``s * B (A x)`` for x [cols] or [..., cols]."""
    return s * ((as64(x) @ as64(a).T) @ as64(b).T)


def _bf16():
    import ml_dtypes  # a dependency of lora

    return np.dtype(ml_dtypes.bfloat16)


def act_pair(torch, x32, oshape, act, kind):
    """x and a zero out of dtype `act` ("float32" | "bfloat16"), as NumPy arrays (bfloat16 from
    ml_dtypes) or, kind "tensor", CPU torch tensors (rounded to nearest even either way)."""
    if kind == "tensor":
        td = torch.float32 if act == "float32" else torch.bfloat16
        return torch.from_numpy(x32).to(td), torch.zeros(oshape, dtype=td)
    nd = np.dtype(np.float32) if act == "float32" else _bf16()
    return x32.astype(nd), np.zeros(oshape, nd)
