"""`load_gguf`: llama.cpp LoRA adapter GGUF files, read through a strict, bounds-checked
`gguf.GGUFReader` and built by `lora.adapter.build_adapter`."""

import math
import os
import re
import warnings
from pathlib import Path

import numpy as np

from .adapter import (Pair, build_adapter, check_finite, format_error, pair_storage, scale_arg,
                      storage_arg)
from .. import _formats as formats
from ..errors import LoraFormatError

__all__ = ["load_gguf"]

# llama.cpp's routed-experts tensors (gguf-py constants: FFN_{GATE,UP,DOWN,GATE_UP}_EXP), whose
# LoRA factors are 3-D and are read as LoraExperts
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(?:gate|up|down|gate_up)_exps\.weight")


def is_gguf_file(path):
    """True when ``path`` is a file that starts with the GGUF magic (``b"GGUF"``); False for a
    directory, a missing or unreadable file, or any other file."""
    try:
        if not os.path.isfile(path):  # never open a FIFO or device: the read could block
            return False
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except (OSError, ValueError):
        return False


class _GGUFTensorError(Exception):
    """A tensor whose data the reader could not map; carries the tensor's name."""

    def __init__(self, name, cause):
        super().__init__(str(cause))
        self.name = name


# metadata arrays longer than this are refused before the reader expands them
_GGUF_MAX_META_ARRAY = 4096


def _strict_reader_class():
    """`gguf.GGUFReader` whose reads must lie inside the file.

    The stock reader slices its memory map without bounds checks: a size past the end yields a
    short view that fails later with an unrelated message, and a huge count of one-byte metadata
    elements loops without end.  Checking every read against the file makes a truncated file, or
    one that declares a huge tensor or array, fail at the first read past the end -- before
    anything is allocated.  Tensors are mapped one at a time so that
    such a failure names its tensor.

    The overrides below (``_get``, ``_get_field_parts``, ``_build_tensors``) are private methods
    of `gguf.GGUFReader`; this is the one place in the library that touches them.  Tested on the
    ``gguf`` package 0.19.0 (the version ``pyproject.toml`` requires at least); a new ``gguf``
    release must be re-checked against them.
    """
    from gguf import GGUFReader, GGUFValueType

    class _StrictGGUFReader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            # The stock reader builds several Python objects per metadata array element (~175
            # bytes of memory per file byte); a LoRA adapter's metadata has no big arrays.
            if raw_type == GGUFValueType.ARRAY:
                count = int(self._get(int(orig_offs) + 4, np.uint64)[0])
                if count > _GGUF_MAX_META_ARRAY:
                    raise ValueError(f"a metadata array declares {count} elements; a LoRA "
                                     f"adapter carries none over {_GGUF_MAX_META_ARRAY}")
            return super()._get_field_parts(orig_offs, raw_type)

        def _get(self, offset, dtype, count=1, *args, **kwargs):
            offset, count = int(offset), int(count)
            itemsize = np.dtype(dtype).itemsize
            if offset < 0 or count < 0 or offset + itemsize * count > self.data.size:
                raise ValueError(f"the file ends before {count} x {itemsize} bytes at offset "
                                 f"{offset} (it has {self.data.size} bytes)")
            return super()._get(offset, dtype, count, *args, **kwargs)

        def _build_tensors(self, start_offs, fields):
            built, seen = [], set()
            for field in fields:
                if field.name in seen:
                    raise _GGUFTensorError(field.name, "the name occurs twice")
                seen.add(field.name)
                try:
                    super()._build_tensors(start_offs, [field])
                except Exception as exc:
                    raise _GGUFTensorError(field.name, exc) from exc
                built += self.tensors
            self.tensors = built

    return _StrictGGUFReader


def _gguf_str(reader, key, path):
    """A string metadata value; None when absent; a description of the type when not a string.
    Raises LoraFormatError naming the key for a value that is not UTF-8."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types != [GGUFValueType.STRING]:
        return f"<{'/'.join(t.name for t in field.types)} value>"
    try:
        return field.contents()
    except UnicodeDecodeError as exc:
        raise format_error(path, f"the value is not UTF-8 ({exc.reason} at byte {exc.start})",
                     key=key) from None


def _gguf_invocation_tokens(reader, path):
    """llama.cpp's ``adapter.alora.invocation_tokens`` (``llama-adapter.cpp``): an array of
    UINT32 token ids, the only element type llama.cpp accepts (and the one its converter
    writes); None when absent or empty (an empty sequence never activates: plain LoRA)."""
    from gguf import GGUFValueType

    key = "adapter.alora.invocation_tokens"
    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types != [GGUFValueType.ARRAY, GGUFValueType.UINT32] and \
            field.types != [GGUFValueType.ARRAY]:          # an empty array has no element type
        shown = "/".join(t.name for t in field.types)
        raise format_error(path, f"must be an array of UINT32 token ids, as llama.cpp reads it; "
                           f"has type {shown}", key=key)
    tokens = [int(v) for v in field.contents()]
    if any(v > 0x7FFFFFFF for v in tokens):           # llama_token is int32
        raise format_error(path, f"holds a token id past int32: {max(tokens)}", key=key)
    return tuple(tokens) or None


def _gguf_array(tensor, path):
    """The tensor's values as a NumPy array in numpy shape (GGUF ``ne`` reversed)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    tt = tensor.tensor_type
    if tt in (T.F32, T.F16):
        return np.array(tensor.data)
    if tt == T.F64:
        arr = np.array(tensor.data)
        check_finite(path, tensor.name, arr)
        if arr.size and np.abs(arr).max() > np.finfo(np.float32).max:
            raise format_error(path, "F64 values overflow float32", tensor=tensor.name)
        return arr.astype(np.float32)
    if tt == T.BF16:
        import ml_dtypes

        # The reader exposes BF16 as raw bytes [rows, 2 * cols]; reinterpret, copying once.
        return np.array(tensor.data).view(np.uint16).view(ml_dtypes.bfloat16)
    if tt == T.Q8_0:
        _q8_0_blocks(tensor, path)
        return dequantize(tensor.data, T.Q8_0)      # float32, ggml's own dequantization
    raise AssertionError(tt)  # unreachable: types are filtered before reading


def _q8_0_blocks(tensor, path):
    """A Q8_0 tensor's blocks (llama.cpp's block_q8_0: a float16 scale d and 32 int8 values q,
    value d * q, 34 bytes) as a C-contiguous uint8 array ``[..., ne[0] / 32 * 34]``, checked
    before anything is kept: the byte length must be the shape's (ne[0] a multiple of 32), and
    a block whose d is inf or NaN (every value of it non-finite) is refused by its block index
    (before dequantizing, where inf * 0 would also raise NumPy's "invalid value" warning)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    block, block_bytes = GGML_QUANT_SIZES[T.Q8_0]
    ne = [int(n) for n in tensor.shape]
    raw = np.ascontiguousarray(tensor.data).reshape(-1)
    rows = int(np.prod(ne[1:], dtype=np.int64))
    if ne[0] % block or raw.size != rows * (ne[0] // block) * block_bytes:
        raise format_error(path, f"a Q8_0 tensor of ne {ne} is whole blocks of {block} values "
                                 f"along ne[0] ({rows * -(-ne[0] // block) * block_bytes} bytes "
                                 f"when ne[0] is a multiple of {block}); it holds {raw.size} "
                                 f"bytes", tensor=tensor.name)
    d = raw.reshape(-1, block_bytes)[:, :2].copy().view("<f2").reshape(-1)
    bad = np.flatnonzero(~np.isfinite(d))
    if bad.size:
        raise format_error(path, f"holds {bad.size} Q8_0 block(s) whose scale is not finite "
                                 f"(block {int(bad[0])}: {d[bad[0]]}), so is every value of such "
                                 f"a block: non-finite values (inf or NaN)", tensor=tensor.name)
    return raw.reshape(*ne[:0:-1], ne[0] // block * block_bytes)


def load_gguf(path, *, scale=1.0, dtype=None):
    """Load a llama.cpp LoRA adapter GGUF (``convert_lora_to_gguf.py``).

    The file must have ``general.type == "adapter"`` and ``adapter.type == "lora"``; alpha is
    ``adapter.lora.alpha`` (missing = 0, meaning factor 1).  Tensors ``<base>.lora_a`` /
    ``<base>.lora_b`` pair up by base name, which becomes the target whatever it is (llama.cpp's
    converter writes model tensor names, ``blk.3.attn_q.weight``; only a model can tell a name it
    lacks: `LoraAdapter.check_base`); ``*_norm.weight`` tensors are skipped with one
    ``UserWarning`` and a tensor with any other suffix is refused, as llama.cpp
    (``llama-adapter.cpp``) does.  Linear: ``lora_a`` ``ne = [n_in, r]`` and ``lora_b``
    ``ne = [r, n_out]`` are A ``[r, n_in]`` and B ``[n_out, r]`` as stored.  ``token_embd.weight``
    is flipped upstream: ``lora_a`` ``ne = [r, n_vocab]`` is the per-token table and becomes B
    ``[n_vocab, r]``, ``lora_b`` ``ne = [r, n_embd]`` becomes A ``[r, n_embd]`` (transposed), so
    token ``t``'s delta is row ``t`` of ``s * B @ A``.  Routed experts
    (``blk.N.ffn_{gate,up,down,gate_up}_exps.weight``, llama.cpp's ``build_lora_mm_id``):
    ``lora_a`` ``ne = [n_in, r, n_expert]`` and ``lora_b`` ``ne = [r, n_out, n_expert]`` are
    A ``[E, r, n_in]`` and B ``[E, n_out, r]`` as stored, a `LoraExperts`; a 3-D pair on any
    other tensor is refused naming it and its ``ne``.  An activated LoRA's
    ``adapter.alora.invocation_tokens`` (UINT32 array) becomes `LoraAdapter.invocation_tokens`.

    Scale (llama.cpp ``get_scale``): ``scale * alpha / rank``, or ``scale`` when alpha is 0.
    ``dtype``: None keeps F32, F16, BF16 and Q8_0 and turns F64 into float32; or one of
    ``"float32"``, ``"float16"``, ``"bfloat16"`` (every tensor stored so; Q8_0 dequantized first)
    or ``"q8_0"``.  A Q8_0 tensor is kept as it is (``"q8_0"``, its blocks read in place by the
    kernels) where its blocks lie along the axis our q8_0 storage blocks: ``lora_a`` of a linear
    (``ne = [n_in, r]``) or of routed experts; a Q8_0 tensor blocked the other way (``lora_b``,
    ``ne = [r, n_out]``, blocked along the rank; the token embedding's factors) is dequantized
    exactly (``gguf.quants``) to float32.  Under ``dtype=None`` or ``"q8_0"`` no value of a Q8_0
    tensor is ever quantized again: the values the file holds are the values applied;
    ``"q8_0"`` quantizes every other tensor (llama.cpp's rule).  So llama.cpp's usual file
    (``--outtype q8_0``: a Q8_0 ``lora_a``, an F16 ``lora_b`` below rank 32) loads as
    ``"q8_0/float16"`` deltas.

    Raises `LoraFormatError` (naming the file and the tensor or metadata key) for a file that is
    not a GGUF LoRA adapter, wrong ``general.type`` / ``adapter.type``, an
    ``adapter.alora.invocation_tokens`` that is not an array of UINT32, a truncated file or one declaring more data than it
    holds, an unknown tensor name, a pair missing a half, shapes that do not pair, an unsupported
    tensor type or non-finite values; ``FileNotFoundError`` for a missing file; ``ValueError`` for
    a bad ``dtype`` or ``scale``.  Nothing is returned unless the whole file is valid.
    """
    from gguf import GGMLQuantizationType as T, GGUFValueType

    storage = storage_arg(dtype)
    shared = scale_arg(scale)
    p = Path(path)
    if not p.is_file():
        if p.exists() or p.is_symlink():
            raise format_error(p, "not a regular file (a directory, FIFO, device or broken "
                                  "link cannot hold an adapter)")
        raise FileNotFoundError(f"no such file: {os.fspath(p)!r}")
    try:
        reader = _strict_reader_class()(os.fspath(p))
    except _GGUFTensorError as exc:
        raise format_error(p, f"truncated or corrupt: {exc}", tensor=exc.name) from exc
    except Exception as exc:  # ValueError/KeyError/IndexError from the reader, OSError
        raise format_error(p, f"not a readable GGUF file: {exc}") from exc
    if reader.byte_order != "I":
        raise format_error(p, "byte order differs from this machine's; llama.cpp cannot load it either")

    gtype = _gguf_str(reader, "general.type", p)
    if gtype != "adapter":
        raise format_error(p, f"not a LoRA adapter: general.type is {gtype!r}, want 'adapter'",
                     key="general.type")
    atype = _gguf_str(reader, "adapter.type", p)
    if atype != "lora":
        raise format_error(p, f"not a LoRA adapter: adapter.type is {atype!r}, want 'lora'",
                     key="adapter.type")
    invocation_tokens = _gguf_invocation_tokens(reader, p)
    alpha = 0.0
    field = reader.fields.get("adapter.lora.alpha")
    if field is not None:
        numeric = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.INT32,
                   GGUFValueType.UINT32, GGUFValueType.INT64, GGUFValueType.UINT64}
        if len(field.types) != 1 or field.types[0] not in numeric:
            raise format_error(p, f"must be a number, has type {[t.name for t in field.types]}",
                         key="adapter.lora.alpha")
        alpha = float(field.contents())
        if not math.isfinite(alpha):
            raise format_error(p, f"must be finite, got {alpha}", key="adapter.lora.alpha")
    name = _gguf_str(reader, "general.name", p)
    if not isinstance(name, str) or not name:
        name = p.stem

    supported = {T.F32: "float32", T.F16: "float16", T.BF16: "bfloat16",
                 T.Q8_0: "q8_0", T.F64: "float32"}
    halves, order, skipped = {}, [], []
    for t in reader.tensors:
        if t.name.endswith(".lora_a") or t.name.endswith(".lora_b"):
            base, half = t.name[:-7], t.name[-1]
        elif t.name.endswith("_norm.weight"):
            skipped.append(t.name)       # llama.cpp: "TODO: add support for norm vector"
            continue
        else:
            raise format_error(p, "unknown tensor: a LoRA adapter holds only <base>.lora_a / "
                         "<base>.lora_b (and *_norm.weight, skipped)", tensor=t.name)
        if t.tensor_type not in supported:
            raise format_error(p, f"tensor type {t.tensor_type.name} is not supported "
                         "(want F32, F16, BF16, Q8_0 or F64)", tensor=t.name)
        ne = [int(n) for n in t.shape]
        dims = 3 if _EXPERTS.fullmatch(base) else 2
        if dims == 3:
            # a routed-experts tensor (build_lora_mm_id): ne [n_in, r, n_expert] / [r, n_out,
            # n_expert], trailing dimensions of 1 allowed past the third
            if len(ne) < 3 or any(n != 1 for n in ne[3:]):
                raise format_error(p, f"has ne {ne}; a LoRA factor of the expert tensor '{base}' "
                                   "is 3-D (lora_a ne [n_in, r, n_expert], lora_b ne [r, n_out, "
                                   "n_expert])", tensor=t.name)
        # llama.cpp compares ne[0] and ne[1] only, so trailing dimensions of 1 (ne [n, r, 1])
        # are the 2-D factor they hold; any other extra dimension is not a LoRA factor.
        elif len(ne) < 2 or any(n != 1 for n in ne[2:]):
            raise format_error(p, f"has ne {ne}; a LoRA factor is 2-D (ne [n, r], or with "
                               "trailing dimensions of 1 only; 3-D factors belong to the expert "
                               "tensors blk.N.ffn_{gate,up,down,gate_up}_exps.weight)",
                               tensor=t.name)
        if 0 in ne[:dims]:
            raise format_error(p, f"has an empty shape, ne {ne}", tensor=t.name)
        if base not in halves:
            halves[base] = {}
            order.append(base)
        halves[base][half] = t

    if not order:
        raise format_error(p, "not a LoRA adapter: the file holds no .lora_a/.lora_b tensors")

    plan = []
    for base in order:
        h = halves[base]
        for half, other in (("a", "b"), ("b", "a")):
            if half not in h:
                raise format_error(p, f"pair for '{base}' is missing its .lora_{half} half",
                             tensor=h[other].name)
        ta, tb = h["a"], h["b"]
        if _EXPERTS.fullmatch(base):
            ne_a, ne_b = [int(n) for n in ta.shape[:3]], [int(n) for n in tb.shape[:3]]
            if ne_a[1] != ne_b[0] or ne_a[2] != ne_b[2]:
                raise format_error(p, f"shapes do not pair: lora_a ne {ne_a} and lora_b ne "
                                   f"{ne_b} (want ne [n_in, r, n_expert] and [r, n_out, "
                                   f"n_expert]: one rank, one expert count)", tensor=ta.name)
            plan.append((base, ta, tb, None))  # embd None: routed experts
            continue
        ne_a, ne_b = [int(n) for n in ta.shape[:2]], [int(n) for n in tb.shape[:2]]
        # Rank is lora_b's ne[0] everywhere.  Linear: lora_a ne [n_in, r]; token_embd: lora_a
        # ne [r, n_vocab] (llama.cpp's is_token_embd test: the name ends in token_embd.weight).
        embd = base.endswith("token_embd.weight")
        rank_a = ne_a[0] if embd else ne_a[1]
        if rank_a != ne_b[0]:
            layout = "ne [r, n_vocab] and [r, n_embd]" if embd else "ne [n_in, r] and [r, n_out]"
            raise format_error(p, f"shapes do not pair: lora_a ne {ne_a} and lora_b ne {ne_b} "
                         f"(want {layout})", tensor=ta.name)
        plan.append((base, ta, tb, embd))

    pairs = []
    for base, ta, tb, embd in plan:
        arrays = []
        for t in (ta, tb):
            # numpy shape [ne[1], ne[0]] (experts: [ne[2], ne[1], ne[0]]): drops the trailing
            # unit dimensions checked above
            shape = [int(n) for n in t.shape[:2 if embd is not None else 3]][::-1]
            kept = supported[t.tensor_type]
            try:
                if kept == "q8_0" and t is ta and not embd and storage in (None, "q8_0"):
                    # blocks along A's rows: the file's bytes are the blocks q8_0 storage holds
                    arr = formats.Stored(formats.Q8_0, _q8_0_blocks(t, p), shape)
                else:
                    arr = _gguf_array(t, p).reshape(shape)
            except LoraFormatError:
                raise
            except Exception as exc:
                raise format_error(p, f"cannot be read: {exc}", tensor=t.name) from exc
            if not isinstance(arr, formats.Stored):
                check_finite(p, t.name, arr)
                if kept == "q8_0":          # blocked along the other axis: float32, exactly
                    kept = "float32"
                # under dtype="q8_0" a dequantized Q8_0 tensor stays float32 (never quantized
                # again); every other tensor takes the dtype asked for
                if storage is not None and not (storage == "q8_0" and t.tensor_type == T.Q8_0):
                    kept = storage
            arrays.append((arr, kept))
        (a, dta), (b, dtb) = arrays
        if embd:
            a, b = b.T, a       # ours: a = lora_b.T [r, n_embd], b = lora_a [n_vocab, r]
        if dta == "q8_0" or dtb == "q8_0" or storage is not None:
            both = formats.pair_name(dta, dtb)          # each factor's own storage
        else:
            both = pair_storage(dta, dtb)
        pairs.append(Pair(base, a, b, alpha=alpha, rslora=False, zero_alpha=False,
                           storage=both, tensors=(ta.name, tb.name)))
    del reader      # drop the memory map; the deltas own copies

    adapter = build_adapter(pairs, path=p, name=name, alpha=alpha, scale=shared, dtype=None,
                            invocation_tokens=invocation_tokens)
    if skipped:
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        warnings.warn(f"{os.fspath(p)}: skipped {len(skipped)} norm tensor(s) ({shown}), "
                      "as llama.cpp does", UserWarning, stacklevel=2)
    return adapter
