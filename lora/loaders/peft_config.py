"""A PEFT adapter's files and config, read for `load_peft`: where the weights and
``adapter_config.json`` are, the config's checks (what it must hold, what changes the delta so
that a plain B·A would be wrong), aLoRA's invocation tokens, and PEFT's pattern rules
(``target_modules``, ``rank_pattern`` / ``alpha_pattern``: the first key that matches a module
path wins)."""

import json
import math
import os
import re
import warnings
from pathlib import Path

from . import _peft_experts as _experts
from .adapter import TOKEN_ID_MAX, format_error
from .gguf import is_gguf_file

__all__ = ["peft_paths", "peft_config", "peft_pattern_key", "peft_targeted",
           "unmatched_pattern_keys", "warn_unmatched"]

# Config switches that change what the adapter computes, so loading the plain B·A would be wrong.
_PEFT_REFUSED = {
    "lora_bias": "lora_bias adds a bias vector to lora_B; only bias-free LoRA is supported",
    "use_qalora": "QA-LoRA pools the input before lora_A; not a plain LoRA delta",
    "use_bdlora": "BD-LoRA (use_bdlora) is not a plain LoRA delta",
    "arrow_config": "Arrow routes each token among several LoRA experts; not one plain delta",
    "modules_to_save": "modules_to_save stores fully fine-tuned modules, not LoRA deltas",
    "trainable_token_indices": "trainable tokens store replaced embedding rows, not LoRA deltas",
    "layer_replication": "layer_replication changes the base model's layer layout",
}


def peft_paths(path):
    p = Path(path)
    if p.is_dir():
        weights = p / "adapter_model.safetensors"
        if not weights.exists():
            if (p / "adapter_model.bin").exists():
                raise format_error(p / "adapter_model.bin", "pickled PyTorch adapters are not supported; "
                             "save the adapter with safe_serialization=True")
            # PEFT's save_pretrained puts every adapter but "default" in a subdirectory
            subs = sorted(c.name for c in p.iterdir()
                          if (c / "adapter_model.safetensors").is_file())
            hint = (f"; it holds adapters in subdirectories: {', '.join(subs[:5])} (load one of "
                    f"them, e.g. {os.fspath(p / subs[0])!r})") if subs else ""
            raise format_error(p, "not a PEFT adapter directory: adapter_model.safetensors is "
                                  "missing" + hint)
        _regular_file(weights)
        return weights, p / "adapter_config.json", p.name
    if not p.exists():
        raise FileNotFoundError(f"no such file or directory: {os.fspath(p)!r}")
    _regular_file(p)
    if is_gguf_file(p):
        raise format_error(p, "this is a GGUF file, not a PEFT adapter: load it with load_gguf")
    parent = p.parent
    return p, parent / "adapter_config.json", parent.resolve().name or p.stem


def _regular_file(p):
    """A FIFO, device or socket would block or never end a read: refused by name."""
    if p.exists() and not p.is_file():
        raise format_error(p, "not a regular file (a FIFO, device or socket cannot hold an "
                              "adapter)")


def peft_config(cfg_path):
    if not cfg_path.exists():
        raise format_error(cfg_path, "missing: a PEFT adapter needs its adapter_config.json "
                     "beside the weights")
    _regular_file(cfg_path)
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise format_error(cfg_path, f"not a readable JSON config: {type(exc).__name__}: {exc}") from None
    if not isinstance(cfg, dict):
        raise format_error(cfg_path, "not a PEFT config: the JSON is not an object")

    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise format_error(cfg_path, f"not a LoRA adapter: peft_type is {peft_type!r}, want 'LORA'",
                     key="peft_type")
    for key, why in _PEFT_REFUSED.items():
        if cfg.get(key):
            raise format_error(cfg_path, f"unsupported: {why}", key=key)
    if cfg.get("bias", "none") != "none":
        raise format_error(cfg_path, f"unsupported: bias={cfg['bias']!r} trains base biases; only 'none'",
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
            raise format_error(cfg_path, f"must be {want}, got {v!r}", key=key)
        return int(v) if integer else float(v)

    def pattern(key, *, integer):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict):
            raise format_error(cfg_path, f"must be an object, got {type(pat).__name__}", key=key)
        out = {}
        for k, v in pat.items():
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if ok and integer:
                ok = float(v).is_integer() and v > 0
            if not ok:
                want = "a positive integer" if integer else "a finite number"
                raise format_error(cfg_path, f"entry {k!r} must be {want}, got {v!r}", key=key)
            try:  # the pattern as PEFT's matching rule will compile it
                re.compile(rf"(.*\.)?({k})$")
            except re.error as exc:
                raise format_error(cfg_path, f"entry {k!r} is not a valid pattern: {exc}", key=key) from exc
            out[k] = int(v) if integer else float(v)
        return out

    for flag in ("use_rslora", "fan_in_fan_out", "use_dora"):
        if not isinstance(cfg.get(flag, False), bool):
            raise format_error(cfg_path, f"must be true or false, got {cfg[flag]!r}", key=flag)

    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise format_error(cfg_path, f"is not a valid pattern: {exc}", key="target_modules") from exc
    elif targets is not None and not (isinstance(targets, list)
                                      and all(isinstance(t, str) for t in targets)):
        raise format_error(cfg_path, f"must be a string or a list of strings, got {targets!r}",
                     key="target_modules")
    return {
        # PEFT's LoraConfig defaults: r = 8, lora_alpha = 8.
        "r": number("r", 8, integer=True, positive=True),
        "lora_alpha": number("lora_alpha", 8),
        "use_rslora": cfg.get("use_rslora", False),
        "use_dora": cfg.get("use_dora", False),
        "fan_in_fan_out": cfg.get("fan_in_fan_out", False),
        "rank_pattern": pattern("rank_pattern", integer=True),
        "alpha_pattern": pattern("alpha_pattern", integer=False),
        "target_modules": targets,
        "alora_invocation_tokens": _peft_invocation_tokens(cfg_path, cfg),
        "target_parameters": _experts.target_parameters(cfg_path, cfg),
    }


def _peft_invocation_tokens(cfg_path, cfg):
    """Activated LoRA's ``alora_invocation_tokens``: None (absent, null, or an empty list: PEFT
    tests the list's truth, so those are plain LoRA), else a tuple of non-negative int ids."""
    tokens = cfg.get("alora_invocation_tokens")
    if tokens is None or tokens == []:
        return None
    if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                             and 0 <= t <= TOKEN_ID_MAX for t in tokens)):
        raise format_error(cfg_path, f"must be a list of integer token ids in [0, 2**63 - 1] "
                           f"(int64), got {tokens!r}", key="alora_invocation_tokens")
    return tuple(tokens)


def _pattern_matches(key, module):
    """PEFT's pattern rule (tuners/tuners_utils.get_pattern_key): ``re.match(rf"(.*\\.)?({k})$",
    module)``, so a key matches a whole trailing run of path components, or is a regex."""
    return re.match(rf"(.*\.)?({key})$", module) is not None


def peft_pattern_key(keys, module):
    """The first key in file order that matches ``module`` (PEFT's rule); None when none does."""
    return next((k for k in keys if _pattern_matches(k, module)), None)


def peft_targeted(targets, module):
    """PEFT's check_target_module_exists for a saved config: a list matches a module equal to an
    entry or ending in ``.entry``; a string is a regex that must fullmatch; "all-linear" and None
    (the targets were resolved elsewhere) match everything."""
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def unmatched_pattern_keys(cfg, modules):
    """``[(config key, pattern key)]`` for every rank_pattern / alpha_pattern key that matches no
    module of the file under PEFT's pattern rule; PEFT warns about them and ignores them."""
    return [(which, k) for which in ("rank_pattern", "alpha_pattern") for k in cfg[which]
            if not any(_pattern_matches(k, m) for m in modules)]


def warn_unmatched(cfg_path, weights_path, unmatched):
    for which, key in unmatched:  # stacklevel: the caller of load_peft / inspect_peft
        warnings.warn(f"{os.fspath(cfg_path)}: {which} key {key!r} matches no module in "
                      f"{weights_path.name}; it is ignored", UserWarning, stacklevel=3)
