"""`load_peft`: Hugging Face PEFT LoRA adapters (``adapter_config.json`` +
``adapter_model.safetensors``), parsed here (the files and config: `peft_config`) and built by
`adapter.build_adapter`."""

import os
import re

import numpy as np

from .. import _dtypes as dtypes
from . import _peft_experts as _experts
from .adapter import (Pair, build_adapter, check_finite, format_error, pair_storage,
                      scale_arg, storage_arg)
from .peft_config import (peft_config, peft_paths, peft_pattern_key, peft_targeted,
                          unmatched_pattern_keys, warn_unmatched)

__all__ = ["load_peft"]


# <prefix?><module>.lora_A[.<adapter>].weight  and  <prefix?><module>.lora_embedding_A[.<adapter>]
_PEFT_LINEAR = re.compile(r"^(?P<module>.+?)\.lora_(?P<half>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_PEFT_EMBED = re.compile(r"^(?P<module>.+?)\.lora_embedding_(?P<half>[AB])(?:\.(?P<adapter>[^.]+))?$")
# DoRA: <prefix?><module>.lora_magnitude_vector[.<adapter>][.weight]
_PEFT_MAGNITUDE = re.compile(r"^(?P<module>.+?)\.lora_magnitude_vector"
                             r"(?:\.(?P<adapter>(?!weight$)[^.]+))?(?:\.weight)?$")
_PEFT_PREFIX = "base_model.model."

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}



def _safetensors_headers(weights_path, *, adapter_expected=True):
    """[(key, dtype, shape)] from the file's header (safe_open maps the file; no tensor is read).
    A file that is not readable safetensors is a LoraFormatError saying so -- and, when nothing
    else marks it as an adapter (no adapter_config.json beside it), that it is not a LoRA adapter."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(weights_path), framework="np") as fh:
            headers = []
            for key in fh.keys():
                sl = fh.get_slice(key)
                headers.append((key, sl.get_dtype(), tuple(int(n) for n in sl.get_shape())))
    except Exception as exc:  # SafetensorError, OSError: a truncated or foreign file
        what = "not a readable safetensors file" if adapter_expected else \
            "not a LoRA adapter: neither a GGUF file nor a readable safetensors file"
        raise format_error(weights_path, f"{what}: {exc}") from exc
    return headers


def _refuse_a_non_adapter(weights_path, cfg_path):
    """Without adapter_config.json, say first whether the file is a LoRA adapter at all (a random
    file, a base model's model.safetensors), then that the config is missing."""
    if cfg_path.exists():
        return
    headers = _safetensors_headers(weights_path, adapter_expected=False)
    if not any(_PEFT_LINEAR.match(key) or _PEFT_EMBED.match(key) for key, _, _ in headers):
        shown = f" (such as '{headers[0][0]}')" if headers else ""
        raise format_error(weights_path, f"not a LoRA adapter: none of its {len(headers)} "
                           f"tensors{shown} is a lora_A/lora_B or lora_embedding_A/B factor, and "
                           "there is no adapter_config.json beside it")


def _peft_parse(weights_path, cfg_path, shapes=None, base=None, *, need_base=True):
    from safetensors import safe_open

    _refuse_a_non_adapter(weights_path, cfg_path)
    cfg = peft_config(cfg_path)
    headers = _safetensors_headers(weights_path)

    halves = {}      # module -> {"A": (key, dtype, shape), "B": ...}
    kinds = {}       # module -> "linear" | "embedding"
    magnitudes = {}  # module -> (key, dtype, shape): DoRA
    order = []
    adapter_names = set()
    for key, dt, shape in headers:
        m = _PEFT_LINEAR.match(key) or _PEFT_EMBED.match(key)
        if m is None:
            if key.endswith(".base_layer.weight"):
                continue        # the full base copy PEFT saves when embeddings are targeted
            mag = _PEFT_MAGNITUDE.match(key)
            if mag is not None:
                if not cfg["use_dora"]:
                    raise format_error(weights_path, f"a DoRA magnitude vector, but "
                                       f"{cfg_path.name} does not set use_dora", tensor=key)
                module = mag.group("module")
                if module.startswith(_PEFT_PREFIX):
                    module = module[len(_PEFT_PREFIX):]
                if len(shape) != 1 or dt not in _SAFETENSORS_DTYPES:
                    raise format_error(weights_path, f"a DoRA magnitude must be a 1-D F32, F16, "
                                       f"BF16 or F64 vector; got {dt} {list(shape)}", tensor=key)
                if module in magnitudes:
                    raise format_error(weights_path, f"duplicates '{magnitudes[module][0]}'",
                                       tensor=key)
                magnitudes[module] = (key, dt, shape)
                continue
            raise format_error(weights_path, "unknown key: not a PEFT LoRA tensor (want "
                         "<module>.lora_A.weight / .lora_B.weight / .lora_embedding_A / "
                         ".lora_embedding_B)", tensor=key)
        module = m.group("module")
        if module.startswith(_PEFT_PREFIX):
            module = module[len(_PEFT_PREFIX):]
        kind = "embedding" if "lora_embedding_" in key else "linear"
        if m.group("adapter") is not None:
            adapter_names.add(m.group("adapter"))
            if len(adapter_names) > 1:
                names = ", ".join(sorted(adapter_names))
                raise format_error(weights_path, f"holds several adapters ({names}); "
                             "save one adapter per directory", tensor=key)
        if module not in halves:
            halves[module] = {}
            kinds[module] = kind
            order.append(module)
        elif kinds[module] != kind:
            raise format_error(weights_path, f"module '{module}' mixes lora_A/B and lora_embedding_A/B keys",
                         tensor=key)
        half = m.group("half")
        if half in halves[module]:
            raise format_error(weights_path, f"duplicates '{halves[module][half][0]}' (the same lora_{half} "
                         "with and without a prefix or adapter name)", tensor=key)
        if dt not in _SAFETENSORS_DTYPES:
            raise format_error(weights_path, f"dtype {dt} is not supported (want F32, F16, BF16 or F64)",
                         tensor=key)
        if len(shape) != 2:
            raise format_error(weights_path, f"has shape {list(shape)}; a LoRA factor is 2-D "
                         "(convolution LoRA is not supported)", tensor=key)
        if 0 in shape:
            raise format_error(weights_path, f"has an empty shape {list(shape)}", tensor=key)
        halves[module][half] = (key, dt, shape)

    if not order:
        raise format_error(weights_path, "not a LoRA adapter: the file holds no lora_A/lora_B tensors")
    # LoRA on raw parameters (target_parameters: the experts of MoE layers), resolved apart
    order, params = _experts.take_param_targets(weights_path, cfg_path, cfg, halves, kinds, order,
                                                shapes, peft_pattern_key)

    dora_bases = _dora_bases(weights_path, cfg_path, cfg, order, kinds, magnitudes, params, base,
                             need_base)

    # Pairing, ranks and scales for every module before any value is read.
    plan = []
    for module in order:
        h = halves[module]
        for half, other in (("A", "B"), ("B", "A")):
            if half not in h:
                key = h[other][0]
                raise format_error(weights_path, f"pair for module '{module}' is missing its lora_"
                             f"{'embedding_' if kinds[module] == 'embedding' else ''}{half} half",
                             tensor=key)
        (ka, dta, sa), (kb, dtb, sb) = h["A"], h["B"]
        # Linear: lora_A [r, in], lora_B [out, r].  Embedding: lora_embedding_A [r, vocab],
        # lora_embedding_B [dim, r].  Either way the rank is A's rows and B's columns.
        if sa[0] != sb[1]:
            raise format_error(weights_path, f"shapes do not pair: {ka} is {list(sa)} and {kb} is {list(sb)} "
                         f"(rank {sa[0]} vs {sb[1]})", tensor=ka)
        if not peft_targeted(cfg["target_modules"], module):
            raise format_error(weights_path, f"module '{module}' is not matched by target_modules "
                         f"{cfg['target_modules']!r} in {cfg_path.name}", tensor=ka)
        rk = peft_pattern_key(cfg["rank_pattern"], module)
        rank = cfg["rank_pattern"][rk] if rk is not None else cfg["r"]
        if sa[0] != rank:
            src = f"rank_pattern[{rk!r}]" if rk is not None else "r"
            raise format_error(weights_path, f"has rank {sa[0]} but {cfg_path.name} gives {src} = {rank}",
                         tensor=ka)
        ak = peft_pattern_key(cfg["alpha_pattern"], module)
        alpha = cfg["alpha_pattern"][ak] if ak is not None else cfg["lora_alpha"]
        plan.append((module, ka, kb, alpha))

    # Value pass: read, widen F64, check finiteness, transpose embeddings into our layout.
    pairs = []
    try:
        fh_cm = safe_open(os.fspath(weights_path), framework="np")
    except Exception as exc:
        raise format_error(weights_path, f"not a readable safetensors file: {exc}") from exc
    with fh_cm as fh:
        for module, ka, kb, alpha in plan:
            a, b = _read_pair(fh, weights_path, ka, kb)
            if kinds[module] == "embedding":
                # Base = the embedding table [vocab, dim]; token t's delta is s * A[:, t] @ B.T
                # (PEFT Embedding: F.embedding(x, A.T) @ B.T), i.e. row t of s * A.T @ B.T.
                a, b = b.T, a.T      # ours: a [r, dim], b [vocab, r]
            storage = pair_storage(_np_storage(a.dtype), _np_storage(b.dtype))
            pair = Pair(module, a, b, alpha=alpha, rslora=cfg["use_rslora"],
                        zero_alpha=(alpha == 0.0), storage=storage, tensors=(ka, kb))
            if module in dora_bases:
                mkey = magnitudes[module][0]
                mag = _read_tensor(fh, weights_path, mkey)
                pair.dora = (mag, dora_bases[module], kinds[module] == "embedding", mkey)
            pairs.append(pair)
        for p in params:
            a, b = _read_pair(fh, weights_path, p.ka, p.kb)
            storage = pair_storage(_np_storage(a.dtype), _np_storage(b.dtype))
            pairs.append(_experts.param_pair(p, a, b, rslora=cfg["use_rslora"], storage=storage))
    where = {key: i for i, (key, _, _) in enumerate(headers)}
    pairs.sort(key=lambda p: min(where[k] for k in p.tensors))  # file order, both kinds mixed
    return cfg, pairs, unmatched_pattern_keys(cfg, order + [p.name for p in params])


def _read_tensor(fh, weights_path, key):
    """One tensor's values: read, checked finite, F64 narrowed to float32."""
    try:
        arr = fh.get_tensor(key)
    except Exception as exc:
        raise format_error(weights_path, f"cannot be read: {exc}", tensor=key) from exc
    check_finite(weights_path, key, arr)
    if arr.dtype == np.float64:
        if np.abs(arr).max() > np.finfo(np.float32).max:
            raise format_error(weights_path, "F64 values overflow float32", tensor=key)
        arr = arr.astype(np.float32)
    return arr


def _read_pair(fh, weights_path, ka, kb):
    """The two factors' values: read, checked finite, F64 narrowed to float32."""
    return [_read_tensor(fh, weights_path, key) for key in (ka, kb)]


def _dora_bases(weights_path, cfg_path, cfg, order, kinds, magnitudes, params, base,
                need_base=True):
    """{module: its base weight in our layout [rows, cols]} for a DoRA file (``use_dora``), from
    ``base=`` (keys: the module name, with or without ``.weight``, PEFT's ``base_model.model.``
    and ``.base_layer`` wrappers allowed; a ``fan_in_fan_out`` weight [in, out] is taken through
    its transposed view); {} for a plain file.  LoraFormatError for a DoRA file without ``base``
    (unless not `need_base`: then {module: None}, the file checked as far as it goes alone), a
    module without its magnitude or its base weight."""
    if not cfg["use_dora"]:
        return {}
    if params:
        raise format_error(cfg_path, "unsupported: DoRA (use_dora) on target_parameters (the "
                           "experts of MoE layers)", key="use_dora")
    if base is None and need_base:
        raise format_error(cfg_path, "a DoRA adapter (use_dora) needs the base weights, which its "
                           "norms are taken over: pass base= (e.g. load_peft(path, "
                           "base=model.state_dict()), or {module name: weight})", key="use_dora")
    for module, (key, _, _) in magnitudes.items():
        if module not in kinds:
            raise format_error(weights_path, f"a DoRA magnitude for module '{module}', which has "
                               f"no lora_A/lora_B pair", tensor=key)
    if base is None:
        for module in order:
            if module not in magnitudes:
                raise format_error(weights_path, f"DoRA module '{module}' has no "
                                   f"lora_magnitude_vector (use_dora is set)")
        return dict.fromkeys(order)
    values = {}
    for key, value in base.items():  # base_shapes checked the mapping and its keys
        values.setdefault(_experts._unwrapped(key), value)
    out = {}
    for module in order:
        if module not in magnitudes:
            raise format_error(weights_path, f"DoRA module '{module}' has no "
                               f"lora_magnitude_vector (use_dora is set)")
        w = values.get(module, values.get(module + ".weight"))
        if w is None:
            raise format_error(weights_path, f"DoRA module '{module}' needs its base weight, and "
                               f"base= has no '{module}' or '{module}.weight'")
        if not hasattr(w, "dtype") or len(getattr(w, "shape", ())) != 2:
            raise format_error(weights_path, f"DoRA module '{module}': base['{module}'] must be "
                               f"the 2-D weight (an array or tensor), not "
                               f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))}")
        if cfg["fan_in_fan_out"] and kinds[module] == "linear":
            w = w.T  # a Conv1D weight is [in, out]: its transposed view is [out, in]
        out[module] = w
    return out


def _np_storage(dt):
    code = dtypes.np_code(dt)
    if code is None:  # pragma: no cover - dtypes are filtered by the header pass
        raise AssertionError(dt)
    return dtypes.NAME_OF[code]


def inspect_peft(path, *, scale=1.0, dtype=None, base=None):
    """What ``python -m lora inspect`` shows of a PEFT adapter: ``(adapter, magnitudes)``, with
    ``magnitudes`` ``{module: float32 magnitude vector}`` for a DoRA file ({} otherwise).  With
    ``base`` this is `load_peft`'s adapter (`DoraDelta` entries, which hold the norms); without
    it a DoRA file's pairs are plain `LoraDelta` entries (their norms need the base), checked
    as `load_peft` checks them."""
    if base is not None:
        adapter = load_peft(path, scale=scale, dtype=dtype, base=base)
        return adapter, {k: d.magnitude for k, d in adapter.items() if hasattr(d, "magnitude")}
    storage = storage_arg(dtype)
    shared = scale_arg(scale)
    weights_path, cfg_path, name = peft_paths(path)
    cfg, pairs, unmatched = _peft_parse(weights_path, cfg_path, need_base=False)
    magnitudes = {}
    for p in pairs:
        if p.dora is not None:
            mag, _, embedding, key = p.dora
            want = p.a.shape[1] if embedding else p.b.shape[0]  # cols (embedding) or rows
            if mag.shape != (want,):
                raise format_error(weights_path, f"a DoRA magnitude of module '{p.name}' must "
                                   f"have {want} values (one per "
                                   f"{'column' if embedding else 'output row'}); got "
                                   f"{list(mag.shape)}", tensor=key)
            magnitudes[p.name] = np.asarray(mag, dtype=np.float32)
            p.dora = None
    adapter = build_adapter(pairs, path=weights_path, name=name, alpha=cfg["lora_alpha"],
                            scale=shared, dtype=storage,
                            invocation_tokens=cfg["alora_invocation_tokens"])
    warn_unmatched(cfg_path, weights_path, unmatched)
    return adapter, magnitudes


def load_peft(path, *, scale=1.0, dtype=None, base=None):
    """Load a Hugging Face PEFT LoRA adapter.

    ``path`` is the adapter directory or its ``adapter_model.safetensors`` (the
    ``adapter_config.json`` is found beside it).  Keys ``[base_model.model.]<module>.lora_A
    [.<adapter>].weight`` ``[r, in]`` / ``.lora_B...weight`` ``[out, r]`` become a delta with
    ``rows = out``, ``cols = in``; embedding pairs ``<module>.lora_embedding_A`` ``[r, vocab]`` /
    ``.lora_embedding_B`` ``[dim, r]`` are transposed so the base is the embedding table
    (``rows = vocab``, ``cols = dim``) and token ``t``'s delta is row ``t`` of ``s * B @ A``.
    ``*.base_layer.weight`` copies are skipped.  ``fan_in_fan_out`` changes nothing here: A and B
    are used as stored, and the base is merged through its transposed view.  An activated LoRA's
    ``alora_invocation_tokens`` becomes `LoraAdapter.invocation_tokens` (see ``alora_mask``).

    LoRA on raw parameters (``target_parameters``, PEFT's ``ParamWrapper``: the 3-D expert
    weights of mixture-of-experts layers): each targeted parameter becomes a `LoraExperts` keyed
    by the parameter's name (``model.layers.0.mlp.experts.gate_up_proj``), expert ``e``'s pair
    being ``lora_A[e*r:(e+1)*r]`` and ``lora_B[:, e::E]``, in the base layout ``[n_out, n_in]``
    of one expert whichever way the model stores its experts; a 2-D parameter becomes a
    `LoraDelta`.  Several parameters of one module are nested levels whose keys gain one
    ``base_layer.`` each and do not name the parameter: the levels are resolved by PEFT's
    nesting rule (the innermost is the module's first registered targeted parameter), the ranks
    (``r`` / ``rank_pattern`` keyed ``<module>.<parameter>``) and the shapes.  ``base``
    (optional): the model's parameters, ``{name: array, tensor or shape}`` (a transformers
    ``state_dict()``; PEFT's ``base_model.model.`` / ``base_layer.`` names are accepted), which
    decides levels the file leaves ambiguous and is checked against the file: a parameter whose
    expert count or shape disagrees is a `LoraFormatError` naming both.

    DoRA (``use_dora`` in the config, ``<module>.lora_magnitude_vector`` tensors): each module
    becomes a `DoraDelta` (an embedding one with ``embedding=True``, PEFT's per-column rule),
    which needs the module's base weight: ``base`` then maps the module name, with or without
    ``.weight`` (a transformers ``state_dict()``, also a PEFT model's with its
    ``.base_layer.weight`` keys), to the weight as an array or tensor in the model's layout
    (``fan_in_fan_out``: ``[in, out]``, read through its transposed view).  The weights are read
    once into the deltas' statistics, not kept.

    Scale (PEFT ``tuners/lora``): ``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``, per
    module after ``rank_pattern`` / ``alpha_pattern`` (first key ``k`` in file order with
    ``re.match(rf"(.*\\.)?({k})$", module)``), times ``scale`` (a float or a `LoraScale` to
    share).  A module whose alpha is 0 gets a zero delta, with one ``UserWarning``.  A
    ``rank_pattern`` / ``alpha_pattern`` key that matches no module in the file is ignored with a
    ``UserWarning`` naming it, as PEFT warns.

    ``dtype``: None keeps the file's dtype (F32, F16, BF16; F64 becomes float32; a pair whose
    halves differ is stored as float32), or one of ``"float32"``, ``"float16"``, ``"bfloat16"``.

    Raises `LoraFormatError` (naming the file and the tensor or config key) for a file that is not
    a LoRA adapter (a random file, or a base model's ``model.safetensors``: no lora_A/lora_B
    tensors and no config beside it), nested parameter levels that the file and ``base`` do
    not resolve, a DoRA file without ``base`` or whose ``base`` lacks a module's weight, a
    missing or unreadable config, ``peft_type`` other than LORA, ``lora_bias``, other non-LoRA
    options, ``alora_invocation_tokens`` that are not a list of non-negative ints, a truncated or foreign file, an unknown key, a pair missing a half, shapes or ranks
    that do not pair, an unsupported dtype or non-finite values; ``FileNotFoundError`` for a
    missing path; ``ValueError`` for a bad ``dtype`` or ``scale``, ``TypeError`` for a ``base``
    that is not such a mapping.  Nothing is returned unless the whole file is valid.
    """
    storage = storage_arg(dtype)
    shared = scale_arg(scale)
    shapes = _experts.base_shapes(base)
    weights_path, cfg_path, name = peft_paths(path)
    cfg, pairs, unmatched = _peft_parse(weights_path, cfg_path, shapes, base)
    adapter = build_adapter(pairs, path=weights_path, name=name, alpha=cfg["lora_alpha"],
                            scale=shared, dtype=storage,
                            invocation_tokens=cfg["alora_invocation_tokens"])
    warn_unmatched(cfg_path, weights_path, unmatched)
    return adapter


