"""The one map from the C layer's LORA_ERR_* statuses to Python exceptions, with the index C
blamed (an id and its position, a scale) named in the message."""

import numpy as np

from ._lora_cffi import lib


_ID_NOUNS = {"ids": "token id", "adapter_ids": "adapter id", "expert_ids": "expert id"}


def id_error(what, value, position, bound=None):
    """The IndexError for an id out of range, in one wording per kind of id (`what`: "ids",
    "adapter_ids" or "expert_ids"), naming the valid range when `bound` (the number of rows,
    entries or experts) is known."""
    noun = _ID_NOUNS.get(what, f"{what}: id")
    if bound is None:
        valid = ""
    elif what == "ids":
        valid = f" [0, {bound})"
    elif what == "adapter_ids":
        valid = ": valid ids are -1 (no adapter)" + (f" and 0..{bound - 1}" if bound else
                                                     ", the bank has no entries")
    else:
        valid = f": valid ids are -1 (no expert) and 0..{bound - 1}"
    return IndexError(f"{noun} {value} at position {position} is out of range{valid}")


def raise_status(status, *, ids=None, adapter_ids=None, n_entries=None, rows=None, bad=None,
                 scales=None):
    """Turn a LORA_ERR_* status from the C layer into the matching Python exception."""
    pos = int(bad[0]) if bad is not None else -1
    if status == lib.LORA_ERR_OVERLAP:
        raise ValueError("x and out overlap in memory; out must not alias x")
    if status == lib.LORA_ERR_INDEX:
        raise id_error("ids", int(ids.reshape(-1)[pos]), position_of(ids, pos), rows)
    if status == lib.LORA_ERR_ADAPTER:
        raise id_error("adapter_ids", int(adapter_ids.reshape(-1)[pos]),
                       position_of(adapter_ids, pos), n_entries or 0)
    if status == lib.LORA_ERR_SCALE:
        if pos >= 0 and scales is not None:
            raise ValueError(f"scales[{position_of(scales, pos)}] = "
                             f"{float(scales.reshape(-1)[pos])!r} times the effective scale of an "
                             f"adapter at that position is not finite in float32 (the product "
                             f"must be below 3.4e38 in magnitude)")
        raise ValueError("the effective scale (scale x alpha factor) is not finite in float32 "
                         "(|s| must be below 3.4e38)")
    if status == lib.LORA_ERR_ALIGN:
        raise ValueError("x, out or the ids are not aligned to their item size")
    if status == lib.LORA_ERR_NOMEM:
        raise MemoryError("lora-kernels: out of memory for kernel scratch")
    if status == lib.LORA_ERR_DTYPE:
        raise TypeError(f"lora-kernels: a dtype code the C layer does not know reached it (it "
                        f"knows {lib.LORA_DTYPE_COUNT}): the Python dtype table and the C "
                        f"registry disagree")
    raise ValueError(f"lora-kernels: invalid arguments (status {status})")


def position_of(arr, flat_index):
    """A flat position as the index of `arr` (an int for 1-D arrays, a tuple otherwise)."""
    if arr.ndim <= 1:
        return flat_index
    return tuple(int(i) for i in np.unravel_index(flat_index, arr.shape))
