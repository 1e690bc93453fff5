"""Adapter files -> `LoraAdapter`: PEFT safetensors directories and llama.cpp LoRA GGUF files.

Both loaders work in two phases.  The *parse* phase reads the file with its own library
(`safetensors` with the NumPy API, `gguf.GGUFReader` memory-mapped), checks every tensor -- both
halves of every pair present, shapes that pair, a supported dtype, finite values -- and brings each
pair into this library's layout (``a [rank, cols]``, ``b [rows, rank]``, base ``[rows, cols] =
[n_out, n_in]``).  Only when the whole file has passed does the *build* phase copy the pairs into
`LoraDelta` storage, so a bad file never yields a half-loaded adapter.  Every problem with a file is
a `LoraFormatError` whose message starts with the file's path and names the tensor (or config key).
"""

import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from .delta import LoraDelta, peft_delta
from .errors import LoraFormatError, LoraShapeError
from .scale import LoraScale

__all__ = ["LoraAdapter", "load_peft", "load_gguf"]

_STORAGE_DTYPES = ("float32", "float16", "bfloat16")


# --------------------------------------------------------------------------------------------
# the adapter
# --------------------------------------------------------------------------------------------


class LoraAdapter(Mapping):
    """One loaded adapter: a read-only Mapping from the file's own base names to `LoraDelta`.

    Keys are PEFT module paths (``"model.layers.0.self_attn.q_proj"``, without PEFT's
    ``base_model.model.`` prefix) or GGUF base tensor names (``"blk.0.attn_q.weight"``), in file
    order.  Every delta shares the adapter's one `LoraScale`, so ``adapter.scale.set(0.5)``
    rescales every projection at once.

    Attributes: ``name`` (str), ``alpha`` (the file's default alpha: PEFT ``lora_alpha`` or GGUF
    ``adapter.lora.alpha``, 0.0 when absent; per-module alphas are on the deltas), ``scale`` (the
    shared `LoraScale`), ``dtype`` (the storage dtype all deltas share, or ``"mixed"``) and
    ``resident_bytes`` (the sum over the deltas).

    Built by `load_peft` / `load_gguf`; it can also wrap deltas built by hand, which must all share
    ``scale`` (else ``ValueError``).
    """

    __slots__ = ("_deltas", "_name", "_alpha", "_scale")

    def __init__(self, deltas, *, name, alpha, scale):
        if not isinstance(scale, LoraScale):
            raise TypeError(f"scale must be a LoraScale, got {type(scale).__name__}")
        items = dict(deltas)
        for key, delta in items.items():
            if not isinstance(key, str):
                raise TypeError(f"adapter target names must be str, got {key!r}")
            if not isinstance(delta, LoraDelta):
                raise TypeError(f"target {key!r}: expected a LoraDelta, got {type(delta).__name__}")
            if delta.scale is not scale:
                raise ValueError(f"target {key!r}: every delta of an adapter must share its LoraScale")
        self._deltas = items
        self._name = str(name)
        self._alpha = float(alpha)
        self._scale = scale

    # Mapping protocol
    def __getitem__(self, name):
        return self._deltas[name]

    def __iter__(self):
        return iter(self._deltas)

    def __len__(self):
        return len(self._deltas)

    def __contains__(self, name):
        return name in self._deltas

    @property
    def name(self):
        """The adapter's name: the PEFT directory name, or GGUF ``general.name`` (else file stem)."""
        return self._name

    @property
    def alpha(self):
        """The file's default alpha (float): PEFT ``lora_alpha`` / GGUF ``adapter.lora.alpha``."""
        return self._alpha

    @property
    def scale(self):
        """The `LoraScale` every delta of this adapter shares (llama.cpp's user scale)."""
        return self._scale

    @property
    def dtype(self):
        """The storage dtype shared by every delta (``"float32"`` etc.), or ``"mixed"``."""
        kinds = {d.dtype for d in self._deltas.values()}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def resident_bytes(self):
        """Bytes held by all deltas: the sum of ``LoraDelta.resident_bytes``."""
        return sum(d.resident_bytes for d in self._deltas.values())

    def check_base(self, shapes):
        """Check the adapter against a base model's shapes.

        ``shapes`` maps base names to ``(rows, cols)`` = ``(n_out, n_in)`` -- also for PEFT
        ``fan_in_fan_out`` models, whose stored weights are ``[in, out]`` -- or to anything with a
        ``.shape`` (a weight array).  Raises `LoraShapeError` naming the tensor and both shapes for
        a target whose shape differs, and for a target missing from ``shapes``; base names the
        adapter does not target are ignored.  Returns None.
        """
        for key, delta in self._deltas.items():
            want = (delta.rows, delta.cols)
            if key not in shapes:
                raise LoraShapeError(
                    f"adapter target '{key}' [{want[0]} x {want[1]}] is missing from the base shapes",
                    rows=delta.rows, cols=delta.cols, rank=delta.rank)
            given = shapes[key]
            given = getattr(given, "shape", given)
            try:
                got = tuple(int(v) for v in given)
            except (TypeError, ValueError):
                got = None
            if got != want:
                shown = f"[{got[0]} x {got[1]}]" if got is not None and len(got) == 2 else repr(given)
                raise LoraShapeError(
                    f"tensor '{key}': the adapter's delta is [{want[0]} x {want[1]}] "
                    f"(rows x cols) but the base is {shown}",
                    rows=delta.rows, cols=delta.cols, rank=delta.rank)

    def __repr__(self):
        return (f"LoraAdapter(name={self._name!r}, targets={len(self)}, alpha={self._alpha:g}, "
                f"scale={self._scale.value:g}, dtype={self.dtype!r}, "
                f"resident_bytes={self.resident_bytes})")


# --------------------------------------------------------------------------------------------
# shared parse/build machinery
# --------------------------------------------------------------------------------------------


class _Pair:
    """One validated target in our layout, before it becomes a `LoraDelta`."""

    __slots__ = ("name", "a", "b", "alpha", "rslora", "zero_alpha", "storage", "tensors")

    def __init__(self, name, a, b, *, alpha, rslora, zero_alpha, storage, tensors):
        self.name, self.a, self.b = name, a, b        # a [rank, cols], b [rows, rank]
        self.alpha, self.rslora, self.zero_alpha = alpha, rslora, zero_alpha
        self.storage = storage                        # "float32" | "float16" | "bfloat16"
        self.tensors = tensors                        # the file's two tensor names, for messages


def _error(path, what, tensor=None, key=None, pair=None):
    where = os.fspath(path)
    if tensor is not None:
        where += f": tensor '{tensor}'"
    if pair is not None:
        where += f": tensors '{pair[0]}' and '{pair[1]}'"
    if key is not None:
        where += f": key '{key}'"
    return LoraFormatError(f"{where}: {what}")


def _storage_arg(dtype):
    """Normalise the ``dtype=`` argument: None, or one of the storage dtype names."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in _STORAGE_DTYPES:
        raise ValueError(f"dtype must be None, 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    return name


def _scale_arg(scale):
    return scale if isinstance(scale, LoraScale) else LoraScale(scale)


def _pair_storage(dtype_a, dtype_b):
    """The storage dtype that keeps both halves exactly: their common dtype, else float32."""
    return dtype_a if dtype_a == dtype_b else "float32"


def _check_finite(path, tensor, arr):
    # isfinite works for float16 and ml_dtypes.bfloat16 without widening the array.
    if arr.size and not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise _error(path, f"holds {bad} non-finite value(s) (inf or NaN)", tensor=tensor)


def _build(pairs, *, path, name, alpha, scale, dtype):
    """Phase two: copy validated pairs into `LoraDelta` storage; nothing is returned on error."""
    deltas = {}
    zeroed = []
    for p in pairs:
        storage = dtype or p.storage
        try:
            # Overflow into a narrower storage dtype is refused below (the core raises
            # ValueError); NumPy's cast warning on the way there would only repeat it.
            with np.errstate(over="ignore"):
                make = peft_delta if p.zero_alpha else LoraDelta
                delta = make(p.a, p.b, alpha=p.alpha, scale=scale, rslora=p.rslora,
                             dtype=storage)
        except NotImplementedError:
            raise
        except (ValueError, TypeError) as exc:
            raise _error(path, f"cannot be stored as {storage}: {exc}", pair=p.tensors) from exc
        if p.zero_alpha:
            zeroed.append(p.name)
        deltas[p.name] = delta
    if zeroed:
        shown = ", ".join(zeroed[:3]) + (f" and {len(zeroed) - 3} more" if len(zeroed) > 3 else "")
        warnings.warn(f"{os.fspath(path)}: alpha is 0 for {len(zeroed)} module(s) ({shown}): "
                      "PEFT scales them by alpha / r = 0, so their deltas are zero",
                      UserWarning, stacklevel=3)
    return LoraAdapter(deltas, name=name, alpha=alpha, scale=scale)


# --------------------------------------------------------------------------------------------
# PEFT
# --------------------------------------------------------------------------------------------

# <prefix?><module>.lora_A[.<adapter>].weight  and  <prefix?><module>.lora_embedding_A[.<adapter>]
_PEFT_LINEAR = re.compile(r"^(?P<module>.+?)\.lora_(?P<half>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_PEFT_EMBED = re.compile(r"^(?P<module>.+?)\.lora_embedding_(?P<half>[AB])(?:\.(?P<adapter>[^.]+))?$")
_PEFT_PREFIX = "base_model.model."

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}

# Config switches that change what the adapter computes, so loading the plain B·A would be wrong.
_PEFT_REFUSED = {
    "use_dora": "DoRA (use_dora) rescales the merged weight column-wise; it is not a plain LoRA delta",
    "lora_bias": "lora_bias adds a bias vector to lora_B; only bias-free LoRA is supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) applies the delta only after its invocation "
                               "tokens; this library applies a delta everywhere",
    "use_qalora": "QA-LoRA pools the input before lora_A; not a plain LoRA delta",
    "use_bdlora": "BD-LoRA (use_bdlora) is not a plain LoRA delta",
    "arrow_config": "Arrow routes each token among several LoRA experts; not one plain delta",
    "target_parameters": "LoRA on raw parameters (target_parameters) is not supported",
    "modules_to_save": "modules_to_save stores fully fine-tuned modules, not LoRA deltas",
    "trainable_token_indices": "trainable tokens store replaced embedding rows, not LoRA deltas",
    "layer_replication": "layer_replication changes the base model's layer layout",
}


def _peft_paths(path):
    p = Path(path)
    if p.is_dir():
        weights = p / "adapter_model.safetensors"
        if not weights.exists():
            if (p / "adapter_model.bin").exists():
                raise _error(p / "adapter_model.bin", "pickled PyTorch adapters are not supported; "
                             "save the adapter with safe_serialization=True")
            raise _error(p, "not a PEFT adapter directory: adapter_model.safetensors is missing")
        return weights, p / "adapter_config.json", p.name
    if not p.exists():
        raise FileNotFoundError(f"no such file or directory: {os.fspath(p)!r}")
    if _is_gguf(p):
        raise _error(p, "this is a GGUF file, not a PEFT adapter: load it with load_gguf")
    parent = p.parent
    return p, parent / "adapter_config.json", parent.resolve().name or p.stem


def _is_gguf(path):
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _peft_config(cfg_path):
    if not cfg_path.exists():
        raise _error(cfg_path, "missing: a PEFT adapter needs its adapter_config.json "
                     "beside the weights")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _error(cfg_path, f"not a readable JSON config: {type(exc).__name__}: {exc}") from None
    if not isinstance(cfg, dict):
        raise _error(cfg_path, "not a PEFT config: the JSON is not an object")

    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise _error(cfg_path, f"not a LoRA adapter: peft_type is {peft_type!r}, want 'LORA'",
                     key="peft_type")
    for key, why in _PEFT_REFUSED.items():
        if cfg.get(key):
            raise _error(cfg_path, f"unsupported: {why}", key=key)
    if cfg.get("bias", "none") != "none":
        raise _error(cfg_path, f"unsupported: bias={cfg['bias']!r} trains base biases; only 'none'",
                     key="bias")

    def number(key, default, *, integer=False, positive=False):
        v = cfg.get(key, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok and integer:
            ok = float(v).is_integer()
        if ok and positive:
            ok = v > 0
        if not ok:
            want = "a positive integer" if integer else "a finite number"
            raise _error(cfg_path, f"must be {want}, got {v!r}", key=key)
        return int(v) if integer else float(v)

    def pattern(key, *, integer):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict):
            raise _error(cfg_path, f"must be an object, got {type(pat).__name__}", key=key)
        out = {}
        for k, v in pat.items():
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if ok and integer:
                ok = float(v).is_integer() and v > 0
            if not ok:
                want = "a positive integer" if integer else "a finite number"
                raise _error(cfg_path, f"entry {k!r} must be {want}, got {v!r}", key=key)
            try:  # the pattern as PEFT's matching rule will compile it
                re.compile(rf"(.*\.)?({k})$")
            except re.error as exc:
                raise _error(cfg_path, f"entry {k!r} is not a valid pattern: {exc}", key=key) from exc
            out[k] = int(v) if integer else float(v)
        return out

    for flag in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(cfg.get(flag, False), bool):
            raise _error(cfg_path, f"must be true or false, got {cfg[flag]!r}", key=flag)

    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise _error(cfg_path, f"is not a valid pattern: {exc}", key="target_modules") from exc
    elif targets is not None and not (isinstance(targets, list)
                                      and all(isinstance(t, str) for t in targets)):
        raise _error(cfg_path, f"must be a string or a list of strings, got {targets!r}",
                     key="target_modules")
    return {
        # PEFT's LoraConfig defaults: r = 8, lora_alpha = 8.
        "r": number("r", 8, integer=True, positive=True),
        "lora_alpha": number("lora_alpha", 8),
        "use_rslora": cfg.get("use_rslora", False),
        "rank_pattern": pattern("rank_pattern", integer=True),
        "alpha_pattern": pattern("alpha_pattern", integer=False),
        "target_modules": targets,
    }


def _peft_pattern_key(keys, module):
    """PEFT's rule (tuners/tuners_utils.get_pattern_key): the first key k, in file order, with
    ``re.match(rf"(.*\\.)?({k})$", module)``; None when no key matches."""
    for k in keys:
        if re.match(rf"(.*\.)?({k})$", module):
            return k
    return None


def _peft_targeted(targets, module):
    """PEFT's check_target_module_exists for a saved config: a list matches a module equal to an
    entry or ending in ``.entry``; a string is a regex that must fullmatch; "all-linear" and None
    (the targets were resolved elsewhere) match everything."""
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _peft_parse(weights_path, cfg_path):
    from safetensors import safe_open

    cfg = _peft_config(cfg_path)

    # Header pass: names, dtypes and shapes only (safe_open maps the file; no tensor is read).
    try:
        with safe_open(os.fspath(weights_path), framework="np") as fh:
            headers = []
            for key in fh.keys():
                sl = fh.get_slice(key)
                headers.append((key, sl.get_dtype(), tuple(int(n) for n in sl.get_shape())))
    except Exception as exc:  # SafetensorError, OSError: a truncated or foreign file
        raise _error(weights_path, f"not a readable safetensors file: {exc}") from exc

    halves = {}      # module -> {"A": (key, dtype, shape), "B": ...}
    kinds = {}       # module -> "linear" | "embedding"
    order = []
    adapter_names = set()
    for key, dt, shape in headers:
        m = _PEFT_LINEAR.match(key) or _PEFT_EMBED.match(key)
        if m is None:
            if key.endswith(".base_layer.weight"):
                continue        # the full base copy PEFT saves when embeddings are targeted
            if "lora_magnitude_vector" in key:
                raise _error(weights_path, "unsupported: a DoRA magnitude vector (use_dora); "
                             "DoRA is not a plain LoRA delta", tensor=key)
            raise _error(weights_path, "unknown key: not a PEFT LoRA tensor (want "
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
                raise _error(weights_path, f"holds several adapters ({names}); "
                             "save one adapter per directory", tensor=key)
        if module not in halves:
            halves[module] = {}
            kinds[module] = kind
            order.append(module)
        elif kinds[module] != kind:
            raise _error(weights_path, f"module '{module}' mixes lora_A/B and lora_embedding_A/B keys",
                         tensor=key)
        half = m.group("half")
        if half in halves[module]:
            raise _error(weights_path, f"duplicates '{halves[module][half][0]}' (the same lora_{half} "
                         "with and without a prefix or adapter name)", tensor=key)
        if dt not in _SAFETENSORS_DTYPES:
            raise _error(weights_path, f"dtype {dt} is not supported (want F32, F16, BF16 or F64)",
                         tensor=key)
        if len(shape) != 2:
            raise _error(weights_path, f"has shape {list(shape)}; a LoRA factor is 2-D "
                         "(convolution LoRA is not supported)", tensor=key)
        if 0 in shape:
            raise _error(weights_path, f"has an empty shape {list(shape)}", tensor=key)
        halves[module][half] = (key, dt, shape)

    if not order:
        raise _error(weights_path, "not a LoRA adapter: the file holds no lora_A/lora_B tensors")

    # Pairing, ranks and scales for every module before any value is read.
    plan = []
    for module in order:
        h = halves[module]
        for half, other in (("A", "B"), ("B", "A")):
            if half not in h:
                key = h[other][0]
                raise _error(weights_path, f"pair for module '{module}' is missing its lora_"
                             f"{'embedding_' if kinds[module] == 'embedding' else ''}{half} half",
                             tensor=key)
        (ka, dta, sa), (kb, dtb, sb) = h["A"], h["B"]
        # Linear: lora_A [r, in], lora_B [out, r].  Embedding: lora_embedding_A [r, vocab],
        # lora_embedding_B [dim, r].  Either way the rank is A's rows and B's columns.
        if sa[0] != sb[1]:
            raise _error(weights_path, f"shapes do not pair: {ka} is {list(sa)} and {kb} is {list(sb)} "
                         f"(rank {sa[0]} vs {sb[1]})", tensor=ka)
        if not _peft_targeted(cfg["target_modules"], module):
            raise _error(weights_path, f"module '{module}' is not matched by target_modules "
                         f"{cfg['target_modules']!r} in {cfg_path.name}", tensor=ka)
        rk = _peft_pattern_key(cfg["rank_pattern"], module)
        rank = cfg["rank_pattern"][rk] if rk is not None else cfg["r"]
        if sa[0] != rank:
            src = f"rank_pattern[{rk!r}]" if rk is not None else "r"
            raise _error(weights_path, f"has rank {sa[0]} but {cfg_path.name} gives {src} = {rank}",
                         tensor=ka)
        ak = _peft_pattern_key(cfg["alpha_pattern"], module)
        alpha = cfg["alpha_pattern"][ak] if ak is not None else cfg["lora_alpha"]
        plan.append((module, ka, kb, alpha))

    # Value pass: read, widen F64, check finiteness, transpose embeddings into our layout.
    pairs = []
    try:
        fh_cm = safe_open(os.fspath(weights_path), framework="np")
    except Exception as exc:
        raise _error(weights_path, f"not a readable safetensors file: {exc}") from exc
    with fh_cm as fh:
        for module, ka, kb, alpha in plan:
            arrays = []
            for key in (ka, kb):
                try:
                    arr = fh.get_tensor(key)
                except Exception as exc:
                    raise _error(weights_path, f"cannot be read: {exc}", tensor=key) from exc
                _check_finite(weights_path, key, arr)
                if arr.dtype == np.float64:
                    if np.abs(arr).max() > np.finfo(np.float32).max:
                        raise _error(weights_path, "F64 values overflow float32", tensor=key)
                    arr = arr.astype(np.float32)
                arrays.append(arr)
            a, b = arrays
            if kinds[module] == "embedding":
                # Base = the embedding table [vocab, dim]; token t's delta is s * A[:, t] @ B.T
                # (PEFT Embedding: F.embedding(x, A.T) @ B.T), i.e. row t of s * A.T @ B.T.
                a, b = b.T, a.T      # ours: a [r, dim], b [vocab, r]
            storage = _pair_storage(_np_storage(a.dtype), _np_storage(b.dtype))
            pairs.append(_Pair(module, a, b, alpha=alpha, rslora=cfg["use_rslora"],
                               zero_alpha=(alpha == 0.0), storage=storage, tensors=(ka, kb)))
    return cfg, pairs


def _np_storage(dt):
    if dt == np.float32:
        return "float32"
    if dt == np.float16:
        return "float16"
    if dt == ml_dtypes.bfloat16:
        return "bfloat16"
    raise AssertionError(dt)  # unreachable: dtypes are filtered by the header pass


def load_peft(path, *, scale=1.0, dtype=None):
    """Load a Hugging Face PEFT LoRA adapter.

    ``path`` is the adapter directory or its ``adapter_model.safetensors`` (the
    ``adapter_config.json`` is found beside it).  Keys ``[base_model.model.]<module>.lora_A
    [.<adapter>].weight`` ``[r, in]`` / ``.lora_B...weight`` ``[out, r]`` become a delta with
    ``rows = out``, ``cols = in``; embedding pairs ``<module>.lora_embedding_A`` ``[r, vocab]`` /
    ``.lora_embedding_B`` ``[dim, r]`` are transposed so the base is the embedding table
    (``rows = vocab``, ``cols = dim``) and token ``t``'s delta is row ``t`` of ``s * B @ A``.
    ``*.base_layer.weight`` copies are skipped.  ``fan_in_fan_out`` changes nothing here: A and B
    are used as stored, and the base is merged through its transposed view.

    Scale (PEFT ``tuners/lora``): ``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``, per
    module after ``rank_pattern`` / ``alpha_pattern`` (first key ``k`` in file order with
    ``re.match(rf"(.*\\.)?({k})$", module)``), times ``scale`` (a float or a `LoraScale` to
    share).  A module whose alpha is 0 gets a zero delta, with one ``UserWarning``.

    ``dtype``: None keeps the file's dtype (F32, F16, BF16; F64 becomes float32; a pair whose
    halves differ is stored as float32), or one of ``"float32"``, ``"float16"``, ``"bfloat16"``.

    Raises `LoraFormatError` (naming the file and the tensor or config key) for a missing or
    unreadable config, ``peft_type`` other than LORA, DoRA, ``lora_bias``, aLoRA, other non-LoRA
    options, a truncated or foreign file, an unknown key, a pair missing a half, shapes or ranks
    that do not pair, an unsupported dtype or non-finite values; ``FileNotFoundError`` for a
    missing path; ``ValueError`` for a bad ``dtype`` or ``scale``.  Nothing is returned unless
    the whole file is valid.
    """
    storage = _storage_arg(dtype)
    shared = _scale_arg(scale)
    weights_path, cfg_path, name = _peft_paths(path)
    cfg, pairs = _peft_parse(weights_path, cfg_path)
    return _build(pairs, path=weights_path, name=name, alpha=cfg["lora_alpha"], scale=shared,
                  dtype=storage)


# --------------------------------------------------------------------------------------------
# GGUF (llama.cpp)
# --------------------------------------------------------------------------------------------


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
        raise _error(path, f"the value is not UTF-8 ({exc.reason} at byte {exc.start})",
                     key=key) from None


def _gguf_array(tensor, path):
    """The tensor's values as a NumPy array in numpy shape (GGUF ``ne`` reversed)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    tt = tensor.tensor_type
    if tt in (T.F32, T.F16):
        return np.array(tensor.data)
    if tt == T.F64:
        arr = np.array(tensor.data)
        _check_finite(path, tensor.name, arr)
        if arr.size and np.abs(arr).max() > np.finfo(np.float32).max:
            raise _error(path, "F64 values overflow float32", tensor=tensor.name)
        return arr.astype(np.float32)
    if tt == T.BF16:
        # The reader exposes BF16 as raw bytes [rows, 2 * cols]; reinterpret, copying once.
        return np.array(tensor.data).view(np.uint16).view(ml_dtypes.bfloat16)
    if tt == T.Q8_0:
        return dequantize(tensor.data, T.Q8_0)      # float32, ggml's own dequantization
    raise AssertionError(tt)  # unreachable: types are filtered before reading


def load_gguf(path, *, scale=1.0, dtype=None):
    """Load a llama.cpp LoRA adapter GGUF (``convert_lora_to_gguf.py``).

    The file must have ``general.type == "adapter"`` and ``adapter.type == "lora"``; alpha is
    ``adapter.lora.alpha`` (missing = 0, meaning factor 1).  Tensors ``<base>.lora_a`` /
    ``<base>.lora_b`` pair up by base name (``blk.3.attn_q.weight``); ``*_norm.weight`` tensors are
    skipped with one ``UserWarning`` and any other name is refused, as llama.cpp
    (``llama-adapter.cpp``) does.  Linear: ``lora_a`` ``ne = [n_in, r]`` and ``lora_b``
    ``ne = [r, n_out]`` are A ``[r, n_in]`` and B ``[n_out, r]`` as stored.  ``token_embd.weight``
    is flipped upstream: ``lora_a`` ``ne = [r, n_vocab]`` is the per-token table and becomes B
    ``[n_vocab, r]``, ``lora_b`` ``ne = [r, n_embd]`` becomes A ``[r, n_embd]`` (transposed), so
    token ``t``'s delta is row ``t`` of ``s * B @ A``.

    Scale (llama.cpp ``get_scale``): ``scale * alpha / rank``, or ``scale`` when alpha is 0.
    ``dtype``: None keeps F32, F16 and BF16 and turns F64 and Q8_0 (dequantized with
    ``gguf.quants``) into float32; or one of ``"float32"``, ``"float16"``, ``"bfloat16"``.

    Raises `LoraFormatError` (naming the file and the tensor or metadata key) for a file that is
    not a GGUF LoRA adapter, wrong ``general.type`` / ``adapter.type``, an activated LoRA
    (``adapter.alora.invocation_tokens``), a truncated file or one declaring more data than it
    holds, an unknown tensor name, a pair missing a half, shapes that do not pair, an unsupported
    tensor type or non-finite values; ``FileNotFoundError`` for a missing file; ``ValueError`` for
    a bad ``dtype`` or ``scale``.  Nothing is returned unless the whole file is valid.
    """
    from gguf import GGMLQuantizationType as T, GGUFValueType

    storage = _storage_arg(dtype)
    shared = _scale_arg(scale)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {os.fspath(p)!r}")
    try:
        reader = _strict_reader_class()(os.fspath(p))
    except _GGUFTensorError as exc:
        raise _error(p, f"truncated or corrupt: {exc}", tensor=exc.name) from exc
    except Exception as exc:  # ValueError/KeyError/IndexError from the reader, OSError
        raise _error(p, f"not a readable GGUF file: {exc}") from exc
    if reader.byte_order != "I":
        raise _error(p, "byte order differs from this machine's; llama.cpp cannot load it either")

    gtype = _gguf_str(reader, "general.type", p)
    if gtype != "adapter":
        raise _error(p, f"not a LoRA adapter: general.type is {gtype!r}, want 'adapter'",
                     key="general.type")
    atype = _gguf_str(reader, "adapter.type", p)
    if atype != "lora":
        raise _error(p, f"not a LoRA adapter: adapter.type is {atype!r}, want 'lora'",
                     key="adapter.type")
    if "adapter.alora.invocation_tokens" in reader.fields:
        raise _error(p, "unsupported: an activated LoRA (aLoRA) applies its delta only after the "
                     "invocation tokens; this library applies a delta everywhere",
                     key="adapter.alora.invocation_tokens")
    alpha = 0.0
    field = reader.fields.get("adapter.lora.alpha")
    if field is not None:
        numeric = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.INT32,
                   GGUFValueType.UINT32, GGUFValueType.INT64, GGUFValueType.UINT64}
        if len(field.types) != 1 or field.types[0] not in numeric:
            raise _error(p, f"must be a number, has type {[t.name for t in field.types]}",
                         key="adapter.lora.alpha")
        alpha = float(field.contents())
        if not math.isfinite(alpha):
            raise _error(p, f"must be finite, got {alpha}", key="adapter.lora.alpha")
    name = _gguf_str(reader, "general.name", p)
    if not isinstance(name, str) or not name:
        name = p.stem

    supported = {T.F32: "float32", T.F16: "float16", T.BF16: "bfloat16",
                 T.Q8_0: "float32", T.F64: "float32"}
    halves, order, skipped = {}, [], []
    for t in reader.tensors:
        if t.name.endswith(".lora_a") or t.name.endswith(".lora_b"):
            base, half = t.name[:-7], t.name[-1]
        elif t.name.endswith("_norm.weight"):
            skipped.append(t.name)       # llama.cpp: "TODO: add support for norm vector"
            continue
        else:
            raise _error(p, "unknown tensor: a LoRA adapter holds only <base>.lora_a / "
                         "<base>.lora_b (and *_norm.weight, skipped)", tensor=t.name)
        if t.tensor_type not in supported:
            raise _error(p, f"tensor type {t.tensor_type.name} is not supported "
                         "(want F32, F16, BF16, Q8_0 or F64)", tensor=t.name)
        ne = [int(n) for n in t.shape]
        if len(ne) < 2 or any(n != 1 for n in ne[2:]):
            raise _error(p, f"has ne {ne}; a LoRA factor is 2-D", tensor=t.name)
        if 0 in ne[:2]:
            raise _error(p, f"has an empty shape, ne {ne}", tensor=t.name)
        if base not in halves:
            halves[base] = {}
            order.append(base)
        halves[base][half] = t

    if not order:
        raise _error(p, "not a LoRA adapter: the file holds no .lora_a/.lora_b tensors")

    plan = []
    for base in order:
        h = halves[base]
        for half, other in (("a", "b"), ("b", "a")):
            if half not in h:
                raise _error(p, f"pair for '{base}' is missing its .lora_{half} half",
                             tensor=h[other].name)
        ta, tb = h["a"], h["b"]
        ne_a, ne_b = [int(n) for n in ta.shape[:2]], [int(n) for n in tb.shape[:2]]
        # Rank is lora_b's ne[0] everywhere.  Linear: lora_a ne [n_in, r]; token_embd: lora_a
        # ne [r, n_vocab] (llama.cpp's is_token_embd test: the name ends in token_embd.weight).
        embd = base.endswith("token_embd.weight")
        rank_a = ne_a[0] if embd else ne_a[1]
        if rank_a != ne_b[0]:
            layout = "ne [r, n_vocab] and [r, n_embd]" if embd else "ne [n_in, r] and [r, n_out]"
            raise _error(p, f"shapes do not pair: lora_a ne {ne_a} and lora_b ne {ne_b} "
                         f"(want {layout})", tensor=ta.name)
        plan.append((base, ta, tb, embd))

    pairs = []
    for base, ta, tb, embd in plan:
        arrays = []
        for t in (ta, tb):
            try:
                arr = _gguf_array(t, p)
            except LoraFormatError:
                raise
            except Exception as exc:
                raise _error(p, f"cannot be read: {exc}", tensor=t.name) from exc
            _check_finite(p, t.name, arr)
            arrays.append((arr, supported[t.tensor_type]))
        (a, dta), (b, dtb) = arrays
        if embd:
            a, b = b.T, a       # ours: a = lora_b.T [r, n_embd], b = lora_a [n_vocab, r]
        pairs.append(_Pair(base, a, b, alpha=alpha, rslora=False, zero_alpha=False,
                           storage=_pair_storage(dta, dtb), tensors=(ta.name, tb.name)))
    del reader      # drop the memory map; the deltas own copies

    adapter = _build(pairs, path=p, name=name, alpha=alpha, scale=shared, dtype=storage)
    if skipped:
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        warnings.warn(f"{os.fspath(p)}: skipped {len(skipped)} norm tensor(s) ({shown}), "
                      "as llama.cpp does", UserWarning, stacklevel=2)
    return adapter
