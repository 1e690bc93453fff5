"""Write small PEFT and GGUF adapter files -- valid and deliberately broken -- for the loader tests.

Valid files are written with the formats' own writers (`safetensors.numpy.save_file`,
`gguf.GGUFWriter`); a few corruptions no writer will produce (a truncated file, a header that
declares a huge tensor) are made by editing the bytes those writers wrote.
"""

import json
import struct

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import save_file

PREFIX = "base_model.model."


def peft_config(**overrides):
    """An adapter_config.json as PEFT 0.21 writes it for a plain LoRA (r 4, lora_alpha 8)."""
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "lora_bias": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_modules": ["q_proj", "k_proj", "embed_tokens"],
        "modules_to_save": None,
        "task_type": "CAUSAL_LM",
    }
    cfg.update(overrides)
    return cfg


def linear_pair(rng, module, rows, cols, rank, *, dtype=np.float32, prefix=True, infix=None):
    """PEFT keys and values for one Linear: lora_A [rank, cols], lora_B [rows, rank]."""
    base = (PREFIX if prefix else "") + module
    mid = f".{infix}" if infix else ""
    return {
        f"{base}.lora_A{mid}.weight": rng.standard_normal((rank, cols)).astype(dtype),
        f"{base}.lora_B{mid}.weight": rng.standard_normal((rows, rank)).astype(dtype),
    }


def embedding_pair(rng, module, vocab, dim, rank, *, dtype=np.float32, prefix=True, infix=None):
    """PEFT keys and values for one Embedding: lora_embedding_A [rank, vocab], _B [dim, rank]."""
    base = (PREFIX if prefix else "") + module
    mid = f".{infix}" if infix else ""
    return {
        f"{base}.lora_embedding_A{mid}": rng.standard_normal((rank, vocab)).astype(dtype),
        f"{base}.lora_embedding_B{mid}": rng.standard_normal((dim, rank)).astype(dtype),
    }


def param_levels(rng, module, levels, *, dtype=np.float32, prefix=True):
    """PEFT ``ParamWrapper`` keys for LoRA on the parameters of one module (``target_parameters``),
    outermost level first: ``levels`` is ``[(out, in, rank, n_experts)]``; level ``d``'s keys gain
    ``d`` ``base_layer.`` components (PEFT nests one wrapper per parameter); ``lora_A [r*E, in]``,
    ``lora_B [out, r*E]``, expert e's pair ``(lora_A[e*r:(e+1)*r], lora_B[:, e::E])``."""
    tensors = {}
    for depth, (out, n_in, rank, n_experts) in enumerate(levels):
        base = (PREFIX if prefix else "") + module + ".base_layer" * depth
        tensors[f"{base}.lora_A.weight"] = rng.standard_normal((rank * n_experts, n_in)).astype(dtype)
        tensors[f"{base}.lora_B.weight"] = rng.standard_normal((out, rank * n_experts)).astype(dtype)
    return tensors


def write_peft(directory, tensors, config=None):
    """Write ``adapter_model.safetensors`` and ``adapter_config.json``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def write_safetensors_header(path, header, data_len):
    """A safetensors file with a hand-made JSON header followed by ``data_len`` zero bytes."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
    return path


def write_gguf(path, tensors, *, general_type="adapter", adapter_type="lora", alpha=16.0,
               name=None, extra_kv=None):
    """Write a llama.cpp-style LoRA GGUF.

    ``tensors``: a list of ``(name, numpy_array, qtype)``; ``numpy_array`` has the numpy shape
    (GGUF ``ne`` reversed); ``qtype`` None writes the array's own dtype (F32/F16/F64/I32),
    else a `GGMLQuantizationType` (BF16, Q8_0, ...) quantized with `gguf.quants.quantize`.
    None for ``general_type`` / ``adapter_type`` / ``alpha`` leaves that key out.  ``extra_kv``
    values: a str, a list (an array of the writer's default element type), a ``(list,
    GGUFValueType)`` tuple (an array of that element type, as llama.cpp's converter writes
    ``adapter.alora.invocation_tokens`` with UINT32), or a float.
    """
    w = GGUFWriter(str(path), "llama")
    if general_type is not None:
        w.add_string("general.type", general_type)
    if adapter_type is not None:
        w.add_string("adapter.type", adapter_type)
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    if name is not None:
        w.add_string("general.name", name)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, tuple):          # (values, element type): a typed array
            w.add_key_value(key, list(value[0]), GGUFValueType.ARRAY, value[1])
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_float32(key, value)
    for tname, arr, qtype in tensors:
        if qtype is None:
            w.add_tensor(tname, arr)
        else:
            raw = quantize(np.asarray(arr, np.float32), qtype)
            w.add_tensor(tname, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_linear(rng, base, rows, cols, rank, qtype=None, dtype=np.float32):
    """llama.cpp tensors for one linear base ``[rows, cols]``: lora_a ne [cols, rank]
    (numpy [rank, cols]) and lora_b ne [rank, rows] (numpy [rows, rank])."""
    return [
        (f"{base}.lora_a", rng.standard_normal((rank, cols)).astype(dtype), qtype),
        (f"{base}.lora_b", rng.standard_normal((rows, rank)).astype(dtype), qtype),
    ]


def gguf_experts(rng, base, n_experts, rows, cols, rank, qtype=None, dtype=np.float32):
    """llama.cpp tensors for one routed-experts base ``[n_experts, rows, cols]`` (a
    ``blk.N.ffn_*_exps.weight``, ne ``[cols, rows, n_experts]``): lora_a ne ``[cols, rank,
    n_experts]`` (numpy ``[E, rank, cols]``) and lora_b ne ``[rank, rows, n_experts]`` (numpy
    ``[E, rows, rank]``), as ``build_lora_mm_id`` reads them."""
    return [
        (f"{base}.lora_a", rng.standard_normal((n_experts, rank, cols)).astype(dtype), qtype),
        (f"{base}.lora_b", rng.standard_normal((n_experts, rows, rank)).astype(dtype), qtype),
    ]


def gguf_token_embd(rng, vocab, dim, rank, qtype=None):
    """llama.cpp's flipped token_embd pair: lora_a ne [rank, vocab] (numpy [vocab, rank]) and
    lora_b ne [rank, dim] (numpy [dim, rank])."""
    return [
        ("token_embd.weight.lora_a", rng.standard_normal((vocab, rank)).astype(np.float32), qtype),
        ("token_embd.weight.lora_b", rng.standard_normal((dim, rank)).astype(np.float32), qtype),
    ]


def truncate(path, keep):
    """Cut the file down to its first ``keep`` bytes (negative: drop that many from the end)."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return path


def patch_gguf_ne(path, tensor_name, ne):
    """Overwrite the ``ne`` of one tensor in a GGUF header (same number of dims)."""
    reader = GGUFReader(str(path))
    field = next(t.field for t in reader.tensors if t.name == tensor_name)
    dims = field.parts[3]
    assert len(dims) == len(ne)
    offset = int(field.offset) + sum(int(part.nbytes) for part in field.parts[:3])
    del reader, field, dims
    data = bytearray(path.read_bytes())
    data[offset:offset + 8 * len(ne)] = struct.pack(f"<{len(ne)}Q", *ne)
    path.write_bytes(bytes(data))
    return path


def poison_q8_0_scale(path, tensor_name, value=np.inf):
    """Set the f16 scale of the first Q8_0 block of a tensor to `value` (+inf)."""
    reader = GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == tensor_name)
    assert t.tensor_type == GGMLQuantizationType.Q8_0
    offset = int(t.data_offset)
    del reader, t
    data = bytearray(path.read_bytes())
    data[offset:offset + 2] = np.array([value], np.float16).tobytes()
    path.write_bytes(bytes(data))
    return path


def patch_gguf_array_len(path, key, n):
    """Overwrite the element count of a metadata array (the stock reader loops over it)."""
    reader = GGUFReader(str(path))
    field = reader.fields[key]
    # parts: key length, key bytes, value type, element type, element count, elements...
    offset = int(field.offset) + sum(int(part.nbytes) for part in field.parts[:4])
    del reader, field
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = struct.pack("<Q", n)
    path.write_bytes(bytes(data))
    return path
