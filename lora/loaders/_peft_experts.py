"""PEFT ``target_parameters`` adapters (PEFT's ``ParamWrapper``): LoRA on raw parameters, the
3-D expert weights of a mixture-of-experts layer above all.  The part of `lora.peft`'s parse
phase that finds such targets in a file, tells its nested levels apart and brings their
factors into this library's layout.

What PEFT saves (peft/tuners/lora/layer.py, ``ParamWrapper``; tuners_utils ``_inject_parameters``):

- a parameter ``p`` of module ``M`` gets ``lora_A.weight [r*E, in]`` and ``lora_B.weight
  [out, r*E]`` (``in`` / ``out`` in the Linear sense, whichever way the experts are stored:
  ``[E, out, in]``, or ``[E, in, out]`` for transposed experts such as GPT-OSS); expert ``e``'s
  pair is ``lora_A[e*r:(e+1)*r, :]`` and ``lora_B[:, e::E]`` (``get_delta_weight``'s reshape);
  a 2-D parameter has ``E = 1``.
- Several parameters of one module are nested wrappers: the outermost level's keys are
  ``M.lora_A.weight``, the next ``M.base_layer.lora_A.weight``, and so on.  The keys do not
  name the parameter.  PEFT wraps in the module's ``named_parameters(recurse=False)`` order, so
  the innermost level is the first registered targeted parameter.
- ``r`` and ``E`` are not told apart by the shapes (``r*E`` rows): the rank comes from ``r`` or
  ``rank_pattern`` keyed by ``<module>.<parameter>``, which needs the level's parameter first.

So each module's levels are assigned parameter names from ``target_parameters``: every
assignment that the ranks (a whole number of experts, one expert count per module), the known
shape relations of transformers' experts (``gate_up_proj``'s out is twice ``down_proj``'s in,
its in ``down_proj``'s out) and, when given, the model's parameter shapes allow.  One left:
that one.  Several, with the model given: the one its parameter order (registration order, as a
``state_dict()`` lists it) gives.  Otherwise the file is ambiguous and the loader says so.
"""

import itertools
from collections.abc import Mapping
from typing import NamedTuple

from .adapter import Pair, format_error

__all__ = ["ParamPlan", "base_shapes", "target_parameters", "take_param_targets", "param_pair"]

_PREFIX = "base_model.model."
_LEVEL = ".base_layer"

# shape relations of transformers' experts parameters ({name: (in, out)} of one assignment):
# gate and up concatenated ([E, 2I, H]) against down ([E, H, I]); or up ([E, I, H]) alone
_RELATIONS = (
    (("gate_up_proj", "down_proj"),
     lambda s: s["gate_up_proj"][0] == s["down_proj"][1]
     and s["gate_up_proj"][1] == 2 * s["down_proj"][0]),
    (("up_proj", "down_proj"),
     lambda s: s["up_proj"][0] == s["down_proj"][1] and s["up_proj"][1] == s["down_proj"][0]),
)


class ParamPlan(NamedTuple):
    """One resolved parameter target: its name (``<module>.<param>``), the file's two keys,
    rank, expert count, alpha and whether it becomes a `LoraExperts` (else a `LoraDelta`)."""

    name: str
    ka: str
    kb: str
    rank: int
    n_experts: int
    alpha: float
    experts: bool


def target_parameters(cfg_path, raw):
    """The config's ``target_parameters`` (a list of strings; absent or null: none)."""
    targets = raw.get("target_parameters")
    if targets is None:
        return []
    if not (isinstance(targets, list) and all(isinstance(t, str) and t for t in targets)):
        raise format_error(cfg_path, f"must be a list of parameter names, got {targets!r}",
                           key="target_parameters")
    return list(dict.fromkeys(targets))


def _unwrapped(name):
    """A module or parameter path as the model names it: no ``base_model.model.`` prefix and
    no ``.base_layer`` component (PEFT's wrappers)."""
    if name.startswith(_PREFIX):
        name = name[len(_PREFIX):]
    return ".".join(part for part in name.split(".") if part != "base_layer")


def base_shapes(base):
    """``base=`` as ``{parameter name: shape tuple}``, in the mapping's order.  Keys as the model
    names its parameters (a transformers ``state_dict()``) or as a PEFT model's state dict names
    them (``base_model.model.`` prefix, ``base_layer.`` levels); values arrays, tensors or
    shapes.  None: no model given."""
    if base is None:
        return None
    if not isinstance(base, Mapping):
        raise TypeError(f"base must be a mapping of the model's parameter names to arrays, "
                        f"tensors or shapes (e.g. model.state_dict()); got {type(base).__name__}")
    shapes = {}
    for key, value in base.items():
        if not isinstance(key, str):
            raise TypeError(f"base keys must be parameter names (str); got {key!r}")
        shape = getattr(value, "shape", value)
        try:
            shape = tuple(int(v) for v in shape)
        except (TypeError, ValueError):
            raise TypeError(f"base[{key!r}] must be an array, a tensor or a shape; got "
                            f"{type(value).__name__}") from None
        shapes.setdefault(_unwrapped(key), shape)
    return shapes


def _candidates(targets, module):
    """The parameter names of `module` that ``target_parameters`` selects (PEFT's rule: the key
    ``<module>.<param>`` equals a target or ends in ``.<target>``), in the config's order."""
    names = []
    for t in targets:
        mod, _, param = t.rpartition(".")
        if not param:
            continue
        if not mod or module == mod or module.endswith("." + mod):
            if param not in names:
                names.append(param)
    return names


def take_param_targets(path, cfg_path, cfg, halves, kinds, order, shapes, pattern_key):
    """Split the parameter targets off a parse: ``halves[module] = {"A": (key, dtype, shape),
    "B": ...}`` as `lora.peft` collects them, ``order`` the modules in file order.  Returns
    (the plain modules in order, [`ParamPlan`] in file order).  ``pattern_key(keys, name)`` is
    PEFT's rank_pattern / alpha_pattern lookup.  Raises LoraFormatError for a level without a
    parameter to hold, missing levels, pairs that do not pair, and files whose levels cannot be
    told apart (see the module docstring)."""
    targets = cfg["target_parameters"]
    plain, levels, first_seen = [], {}, []
    for module in order:
        base, depth = module, 0
        while base.endswith(_LEVEL):
            base, depth = base[:-len(_LEVEL)], depth + 1
        cands = _candidates(targets, base) if targets else []
        if not cands:
            if depth:
                key = halves[module]["A"][0] if "A" in halves[module] else \
                    halves[module]["B"][0]
                raise format_error(path, f"a nested LoRA level (base_layer.) of module '{base}', "
                                   f"but target_parameters {targets!r} names no parameter of it",
                                   tensor=key)
            plain.append(module)
            continue
        if kinds[module] != "linear":
            raise format_error(path, f"module '{base}' is a target_parameters target; its "
                               "factors are lora_A / lora_B, not lora_embedding_A / _B",
                               tensor=next(iter(halves[module].values()))[0])
        if base not in levels:
            levels[base] = {}
            first_seen.append(base)
        levels[base][depth] = halves[module]
    plans = []
    for base in first_seen:
        plans += _resolve(path, cfg, base, levels[base], shapes, pattern_key)
    return plain, plans


def _resolve(path, cfg, module, by_depth, shapes, pattern_key):
    n = max(by_depth) + 1
    lv = []
    for depth in range(n):
        h = by_depth.get(depth)
        if h is None:
            shown = ".".join([module] + ["base_layer"] * depth)
            raise format_error(path, f"module '{module}' has nested LoRA levels up to depth "
                               f"{n - 1} but none at depth {depth} (keys '{shown}.lora_A.weight' "
                               f"/ '.lora_B.weight')")
        for half, other in (("A", "B"), ("B", "A")):
            if half not in h:
                raise format_error(path, f"pair for parameter level {depth} of module "
                                   f"'{module}' is missing its lora_{half} half",
                                   tensor=h[other][0])
        (ka, _, sa), (kb, _, sb) = h["A"], h["B"]
        if sa[0] != sb[1]:
            raise format_error(path, f"shapes do not pair: {ka} is {list(sa)} and {kb} is "
                               f"{list(sb)} (rank x experts {sa[0]} vs {sb[1]})", tensor=ka)
        lv.append((ka, kb, sa[0], sa[1], sb[0]))  # keys, r*E, in, out
    cands = _candidates(cfg["target_parameters"], module)
    if len(cands) < n:
        raise format_error(path, f"module '{module}' has {n} nested LoRA levels but "
                           f"target_parameters {cfg['target_parameters']!r} names only "
                           f"{len(cands)} of its parameters ({', '.join(cands)})",
                           tensor=lv[0][0])
    known = shapes is not None and any(f"{module}.{c}" in shapes for c in cands)
    registered = None
    if known:  # the model's parameter order: the innermost level is the first registered one
        present = [name.rpartition(".")[2] for name in shapes
                   if name.rpartition(".")[0] == module and name.rpartition(".")[2] in cands]
        registered = tuple(reversed(present[:n])) if len(present) >= n else None
    tries = list(itertools.permutations(cands, n))
    if registered in tries:  # tried first: its misfit is the one to report
        tries.remove(registered)
        tries.insert(0, registered)
    fits, first_why = [], None
    for names in tries:
        got = _fit(module, lv, names, cfg, shapes if known else None, pattern_key)
        if isinstance(got, str):
            first_why = first_why or got
        else:
            fits.append((names, got))
    if not fits:
        raise format_error(path, f"module '{module}': its LoRA levels fit none of its "
                           f"target parameters ({', '.join(cands)}): {first_why}",
                           tensor=lv[0][0])
    if len(fits) > 1 and known:
        fits = [f for f in fits if f[0] == registered]
    if len(fits) != 1:
        shown = "; ".join(", ".join(f"level {d} = {p}" for d, p in enumerate(names))
                          for names, _ in fits[:4]) if fits else "none in the model's order"
        raise format_error(
            path, f"module '{module}' has {n} nested LoRA levels (level 0 the outermost, keys "
            f"without base_layer.) and the file does not say which of its target parameters "
            f"({', '.join(cands)}) each holds: {shown} all fit its shapes and ranks. Pass "
            f"base= (the model's state_dict(), or {{parameter name: shape}} of its expert "
            f"parameters) to load_peft to resolve them", tensor=lv[0][0])
    return fits[0][1]


def _fit(module, lv, names, cfg, shapes, pattern_key):
    """The plans of one assignment of parameter names to levels, or why it does not fit."""
    plans, sizes, experts = [], {}, set()
    for (ka, kb, rows_a, n_in, n_out), p in zip(lv, names):
        name = f"{module}.{p}"
        rk = pattern_key(cfg["rank_pattern"], name)
        r = cfg["rank_pattern"][rk] if rk is not None else cfg["r"]
        src = f"rank_pattern[{rk!r}]" if rk is not None else "r"
        if rows_a % r:
            return (f"as '{name}', {ka} has {rows_a} rows, not a multiple of its rank {r} "
                    f"({src})")
        e = rows_a // r
        is_experts = e > 1
        if shapes is not None:
            shape = shapes.get(name)
            if shape is None:
                return f"the model has no parameter '{name}'"
            if len(shape) == 3:
                if shape[0] != e or (shape[1], shape[2]) not in ((n_out, n_in), (n_in, n_out)):
                    return (f"as '{name}', {ka} has {rows_a} rows = rank {r} ({src}) x {e} "
                            f"experts of [{n_out} x {n_in}] (out x in), but the model's '{name}' "
                            f"has shape {shape} ({shape[0]} experts)")
                is_experts = True
            elif len(shape) != 2 or e != 1 or shape != (n_out, n_in):
                return (f"as '{name}', {ka} holds {e} expert(s) of [{n_out} x {n_in}] (out x "
                        f"in) at rank {r} ({src}), but the model's '{name}' has shape {shape}")
        if e > 1:
            experts.add(e)
        sizes[p] = (n_in, n_out)
        ak = pattern_key(cfg["alpha_pattern"], name)
        alpha = cfg["alpha_pattern"][ak] if ak is not None else cfg["lora_alpha"]
        plans.append(ParamPlan(name, ka, kb, r, e, alpha, is_experts))
    if len(experts) > 1:
        return (f"the levels as {', '.join(names)} would hold {sorted(experts)} experts; one "
                f"experts module has one expert count")
    for need, holds in _RELATIONS:
        if all(p in sizes for p in need) and not holds(sizes):
            return (f"as {', '.join(names)} the levels' shapes (in, out) "
                    f"{[sizes[p] for p in need]} do not relate as {' and '.join(need)} do")
    return plans


def param_pair(plan, a, b, *, rslora, storage):
    """The `Pair` of one parameter target from PEFT's ``lora_A [r*E, in]`` / ``lora_B [out,
    r*E]``: expert e's ``(lora_A[e*r:(e+1)*r], lora_B[:, e::E])``, stacked ``[E, r, in]`` /
    ``[E, out, r]``; a single expert of a 2-D parameter as the 2-D pair."""
    r, e = plan.rank, plan.n_experts
    if plan.experts:
        a = a.reshape(e, r, a.shape[1])
        b = b.reshape(b.shape[0], r, e).transpose(2, 0, 1).copy()
    return Pair(plan.name, a, b, alpha=plan.alpha, rslora=rslora, zero_alpha=(plan.alpha == 0.0),
                storage=storage, tensors=(plan.ka, plan.kb))

