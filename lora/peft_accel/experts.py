"""`accelerate_peft` for PEFT's ``ParamWrapper`` on transformers' experts modules (MoE models).

PEFT's LoRA on 3-D expert weights (``target_parameters``) wraps the experts module in one
``ParamWrapper`` per targeted parameter (nested: ``gate_up_proj`` and ``down_proj`` of one
module are two levels) and, at every forward, adds ``s * B_e A_e`` to *every* expert's weight
before transformers' experts function runs.  A served layer replaces the outermost wrapper's
forward with an experts forward of its own, the computation of transformers' ``grouped_mm``
experts function with the LoRA term added between the projections:

    sort the (token, slot) pairs by expert; x_g = the pairs' token rows
    h = x_g @ up_e (+ bias_e)            torch grouped by expert, then += s B_e (A_e x_g) for the
                                          routed pairs only (`LoraExperts`, one C call per level)
    h = _apply_gate(h) if has_gate else act_fn(h)            the class's own gate / activation
    d = h @ down_e (+ bias_e)            torch, then += s B_e (A_e h) likewise
    d = post_expert_norm(d) if has_post_expert_norm; times the routing weights; back to token
    order and summed over the k slots

honouring the flags transformers' ``use_experts_implementation`` sets on the class
(``has_gate``, ``has_bias``, ``is_transposed``; ``is_concatenated`` lives in the class's
``_apply_gate``).  A class not built through that interface, an experts implementation other
than ``eager`` / ``grouped_mm`` / ``batched_mm`` (the ones that compute this), expert
parallelism, or a wrapper on a parameter this forward does not read: PEFT's own forward, with
the reason in ``skipped``.

PEFT keeps ``lora_A [r*E, in]`` (expert e's rows ``e*r .. e*r+r``, read in place) and ``lora_B
[out, r*E]`` interleaved, expert fastest; each adapter's ``lora_B`` is repacked expert-major
(``[E, r, out]``, the kernels' B^T rows) once, and again when the tensor's version counter, data
pointer or shape moves, or PEFT's hotswap ran (its entry points are wrapped while a layer is
served: hotswap writes through ``.data``, which the version counter does not see).  The
repacked bytes are what ``acc.extra_bytes`` reports.  A mixed batch (``adapter_names``, which
PEFT refuses here) is one bank call per level: the experts see ``[batch * seq, hidden]``, so
each sequence's adapter repeats over its positions.
"""

import functools
import inspect

from .. import _dtypes as dtypes
from .._entries import EntryTable
from ..kinds.delta import LoraDelta
from ..kinds.experts import LoraExperts
from ..scale import F32_OVERFLOW, LoraScale
from .served import ServedLayer, hook_reason, version
from .torch_op import compiling as _compiling, eager as _eager

__all__ = ["Kind", "Layer"]

_KNOWN_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")  # besides "eager" (and None: eager)

# ------------------------------------------------------------------ PEFT's hotswap, observed

_SWAPS = [0]       # bumped around every hotswap call: part of every repack's key
_HOOKS = {}        # entry-point name -> (PEFT's function, our wrapper) while installed
_USERS = [0]       # served experts layers alive


def _observed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _SWAPS[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _SWAPS[0] += 1
    return wrapper


def _hook_hotswap():
    """While any experts layer is served, PEFT's hotswap entry points bump `_SWAPS`.  Besides
    the two public functions, the per-key scaling helper is wrapped: ``hotswap_adapter_from_
    state_dict`` looks it up at call time, so even a reference to it taken before
    accelerate_peft is seen (it runs before each key's weights are copied)."""
    _USERS[0] += 1
    if _USERS[0] > 1:
        return
    try:
        from peft.utils import hotswap
    except ImportError:  # pragma: no cover - a PEFT without hotswap
        return
    for name in ("hotswap_adapter", "hotswap_adapter_from_state_dict", "_update_scaling"):
        fn = getattr(hotswap, name, None)
        if callable(fn):
            _HOOKS[name] = (fn, _observed(fn))
            setattr(hotswap, name, _HOOKS[name][1])


def _unhook_hotswap():
    _USERS[0] -= 1
    if _USERS[0] > 0:
        return
    from peft.utils import hotswap

    for name, (fn, wrapper) in _HOOKS.items():
        if getattr(hotswap, name, None) is wrapper:  # nobody wrapped it after us
            setattr(hotswap, name, fn)
    _HOOKS.clear()


# ------------------------------------------------------------------ the kind


class Kind:
    """PEFT's ``ParamWrapper`` levels on a transformers experts module, for one
    `PeftAcceleration`."""

    def __init__(self, acc):
        self.acc = acc
        try:
            from peft.tuners.lora.layer import ParamWrapper
            from transformers.integrations import moe
        except ImportError:  # a PEFT without target_parameters, or no transformers
            ParamWrapper = moe = None
        self.wrapper, self.moe = ParamWrapper, moe

    def layer(self, name, module):
        """A served `Layer` over `module` when it is an outermost ``ParamWrapper`` (the inner
        levels are its own, `Layer.covers`), else None."""
        if self.wrapper is not None and type(module) is self.wrapper:
            return Layer(self, name, module)
        return None

    def interface_reason(self, experts):
        """Why `experts` is not a module whose forward is transformers' experts interface, or
        None."""
        moe = self.moe
        fwd = getattr(type(experts), "forward", None)
        cells = {}
        code = getattr(fwd, "__code__", None)
        if code is not None and getattr(fwd, "__closure__", None):
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in fwd.__closure__)))
        if (moe is None or getattr(fwd, "__globals__", {}).get("__name__") != moe.__name__
                or cells.get("experts_interface") is not moe.ALL_EXPERTS_FUNCTIONS
                or not all(hasattr(experts, f) for f in ("has_gate", "has_bias", "is_transposed",
                                                          "has_post_expert_norm", "config"))):
            return (f"{type(experts).__name__} is not an experts module of transformers' "
                    f"experts interface")
        return None

    def implementation_reason(self, experts):
        """Why the experts' current implementation is not one this forward computes, or None."""
        impl = getattr(experts.config, "_experts_implementation", None)
        if impl is None or impl == "eager":
            return None
        moe = self.moe
        fn = moe.ALL_EXPERTS_FUNCTIONS.get(impl) if impl in _KNOWN_IMPLEMENTATIONS else None
        if fn is None or fn is not getattr(moe, f"{impl}_experts_forward", None):
            return f"experts implementation {impl!r} is not one lora-kernels computes"
        return None


class _Adapter:
    """One adapter of one level: `LoraExperts` over PEFT's lora_A (in place) and a repacked
    lora_B, and the keys that say when either must be built again."""

    __slots__ = ("a_key", "b_key", "packed", "experts", "scale")

    def __init__(self):
        self.a_key = self.b_key = self.packed = self.experts = None
        self.scale = LoraScale(0.0)


class _Level:
    """One ``ParamWrapper`` level: the wrapper, its parameter's role ("up": gate_up_proj or
    up_proj, "down": down_proj), its adapters and the bank tables of mixed batches."""

    __slots__ = ("wrapper", "role", "adapters", "tables")

    def __init__(self, wrapper, role):
        self.wrapper, self.role = wrapper, role
        self.adapters = {}  # adapter name -> _Adapter
        self.tables = {}    # tuple of LoraExperts ids -> (EntryTable, experts kept alive)

    def view(self, torch, a):
        """`LoraExperts` for adapter `a` as its tensors are now, or a reason string."""
        w = self.wrapper
        ta, tb = w.lora_A[a].weight, w.lora_B[a].weight
        got = self.adapters.get(a)
        if got is None:
            got = self.adapters[a] = _Adapter()
        a_key = (ta.data_ptr(), ta.dtype, tuple(ta.shape), ta.stride())
        b_key = (tb.data_ptr(), version(tb), _SWAPS[0], tb.dtype, tuple(tb.shape), tb.stride())
        if got.a_key == a_key and got.b_key == b_key:
            return got.experts
        name = dtypes.NAME_OF.get(dtypes.torch_codes().get(ta.dtype))
        if name is None or tb.dtype != ta.dtype:
            return f"adapter {a!r} weights are {ta.dtype}/{tb.dtype}"
        if not (ta.is_cpu and tb.is_cpu):
            return f"adapter {a!r} weights are on {ta.device}"
        n_experts, r = w.num_experts, w.r[a]
        (ra, cols), (rows, rb) = ta.shape, tb.shape
        if ra != r * n_experts or rb != r * n_experts:
            return (f"adapter {a!r} factors {tuple(ta.shape)} / {tuple(tb.shape)} do not hold "
                    f"{n_experts} experts of rank {r}")
        if not ta.is_contiguous():
            return f"adapter {a!r} lora_A is not contiguous"
        packed = got.packed
        if packed is None or packed.dtype != tb.dtype or tuple(packed.shape) != (n_experts, r, rows):
            packed = torch.empty((n_experts, r, rows), dtype=tb.dtype)
        with torch.no_grad():  # B[o, j*E + e] -> packed[e, j, o]: expert e's B^T rows
            packed.copy_(tb.detach().reshape(rows, r, n_experts).permute(2, 1, 0))
        if got.experts is None or got.a_key != a_key or got.packed is not packed:
            isz = ta.element_size()
            pa, pb, keep = ta.data_ptr(), packed.data_ptr(), (ta.detach(), packed)
            got.experts = LoraExperts._from_deltas(
                LoraDelta.view((pa + e * r * cols * isz, cols), (pb + e * r * rows * isz, rows),
                               dtype=name, rank=r, rows=rows, cols=cols, scale=got.scale,
                               keep=keep)
                for e in range(n_experts))
            self.tables.clear()  # tables over the old experts would keep their memory alive
        got.packed, got.a_key, got.b_key = packed, a_key, b_key
        return got.experts

    def table(self, experts):
        key = tuple(id(e) for e in experts)
        got = self.tables.get(key)
        if got is None:
            if len(self.tables) > 64:
                self.tables.clear()
            got = self.tables[key] = (EntryTable(experts, "adapter", routed=True), experts)
        return got[0]


class Layer(ServedLayer):
    """The outermost ``ParamWrapper`` of one experts module, served by the experts forward
    described in the module docstring."""

    __slots__ = ("kind", "experts", "levels", "why", "names", "grouped", "torch")

    def __init__(self, kind, name, module):
        self.kind = kind
        self.torch = kind.acc._torch
        chain = []
        m = module
        while type(m) is kind.wrapper:
            chain.append(m)
            m = m.base_layer
        self.experts = m
        self.levels = []
        self.names = None
        self.grouped = hasattr(self.torch.nn.functional, "grouped_mm")
        self.why = kind.interface_reason(m)
        if self.why is None:
            up = "gate_up_proj" if m.has_gate else "up_proj"
            roles = {up: "up", "down_proj": "down"}
            seen = set()
            for w in chain:
                role = roles.get(w.parameter_name)
                param = getattr(m, w.parameter_name, None)
                if role is None or role in seen:
                    self.why = (f"the LoRA targets {w.parameter_name!r}, which the experts "
                                f"forward does not read as a weight")
                    break
                if getattr(param, "ndim", 0) != 3:
                    self.why = f"the experts' {w.parameter_name!r} is not a 3-D weight"
                    break
                seen.add(role)
                self.levels.append(_Level(w, role))
            if self.why is None:
                self.names = self._argument_names(m)
                if self.names is None:
                    self.why = f"{type(m).__name__}.forward does not take (hidden, ids, weights)"
        super().__init__(kind.acc, name, module)
        _hook_hotswap()

    @staticmethod
    def _argument_names(experts):
        try:
            params = list(inspect.signature(type(experts).forward).parameters.values())[1:]
        except (TypeError, ValueError):
            return None
        if len(params) < 3 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                  for p in params[:3]):
            return None
        return tuple(p.name for p in params[:3])

    # ------------------------------------------------------------------ ServedLayer
    def static_reason(self):
        return self.why

    def covers(self):
        """The inner modules this layer answers for: the nested wrappers (and their experts)."""
        return [lv.wrapper for lv in self.levels[1:]] + [self.experts]

    def extra_bytes(self):
        return sum(ad.packed.numel() * ad.packed.element_size() for lv in self.levels
                   for ad in lv.adapters.values() if ad.packed is not None)

    def refresh(self):
        for lv in self.levels:
            lv.adapters.clear()
            lv.tables.clear()

    def unpatch(self):
        super().unpatch()
        self.refresh()
        if self.kind is not None:
            _unhook_hotswap()
            self.kind = None

    # ------------------------------------------------------------------ forward
    def forward(self, x, *args, **kwargs):
        if _compiling():  # torch.compile traces this call: the experts forward is not traceable
            return _eager(self._forward, x, *args, **kwargs)  # (cffi calls): one graph break
        return self._forward(x, *args, **kwargs)

    def _forward(self, x, *args, **kwargs):
        acc = self.acc
        adapter_names = kwargs.get("adapter_names")
        why = self.why
        if why is None:
            why, call = self._plan(x, args, kwargs, adapter_names)
        if why is not None:
            acc._status[self.name] = why
            return self.original(x, *args, **kwargs)
        hidden, ids, weights, per_level = call
        for lv in self.levels:  # PEFT's forward unmerges a disabled level's merged adapters
            w = lv.wrapper
            if w.disable_adapters and w.merged:
                w.unmerge()
        acc._status[self.name] = None
        return self._experts_forward(hidden, ids, weights, per_level, adapter_names)

    def _plan(self, x, args, kwargs, adapter_names):
        """(reason, None) for PEFT's forward, or (None, (hidden, ids, weights, {role: terms}))
        where terms is a list of LoraExperts (active adapters, in PEFT's order) or, for a mixed
        batch, (EntryTable, per-sequence slot ids)."""
        torch = self.torch
        experts = self.experts
        why = self.kind.implementation_reason(experts)
        if why is not None:
            return why, None
        if getattr(experts, "_is_expert_parallel", False):
            return "the experts are expert-parallel (sentinel ids)", None
        bound = self._bind(x, args, kwargs)
        if bound is None:
            return "the experts were called with other arguments", None
        hidden, ids, weights = bound
        if not all(isinstance(t, torch.Tensor) and t.is_cpu for t in bound):
            return "the input is not a CPU tensor", None
        if hidden.dim() != 2 or ids.dim() != 2 or tuple(weights.shape) != tuple(ids.shape) \
                or ids.shape[0] != hidden.shape[0] or not hidden.shape[0]:
            return "the experts' inputs are not [tokens, hidden] with [tokens, k] routing", None
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            return f"the expert ids are {ids.dtype}", None
        codes = dtypes.torch_codes()
        for lv in self.levels:
            p = getattr(experts, lv.wrapper.parameter_name)
            if codes.get(p.dtype) is None or not p.is_cpu:
                return f"the experts' {lv.wrapper.parameter_name} is {p.dtype} on {p.device}", None
        grad = torch.is_grad_enabled()
        if grad and hidden.requires_grad:
            return "autograd is recording (the input requires grad)", None
        if grad and any(p.requires_grad for p in experts.parameters()):
            return "autograd is recording (the expert weights require grad)", None
        hooked = hook_reason(self.acc, self.module, (), ())
        if hooked is None and (experts._forward_hooks or experts._forward_pre_hooks):
            hooked = (f"the experts module has forward hooks (PEFT's forward runs while they are "
                      f"registered)")
        if hooked is not None:
            return hooked, None
        per_level = {}
        mixed = adapter_names is not None
        if mixed:
            n_seq = len(adapter_names)
            if any(lv.wrapper.merged for lv in self.levels):
                raise ValueError("Cannot pass `adapter_names` when there are merged adapters, "
                                 "please call `unmerge_adapter` first.")
            if not n_seq or hidden.shape[0] % n_seq:
                raise ValueError(f"adapter_names has {n_seq} names but the experts got "
                                 f"{hidden.shape[0]} token rows: every sequence must contribute "
                                 f"the same number of rows")
        for lv in self.levels:
            w = lv.wrapper
            if w.disable_adapters or (w.merged and not mixed):
                continue
            keys = w.lora_A
            if len(lv.adapters) > len(keys):  # deleted adapters: let their memory go
                for a in [a for a in lv.adapters if a not in keys]:
                    del lv.adapters[a]
                lv.tables.clear()
            if mixed:
                names = [a for a in dict.fromkeys(adapter_names) if a != "__base__" and a in keys]
            else:
                names = [a for a in w.active_adapters if a in keys]
            if not names:
                continue
            views = []
            for a in names:
                if grad and (w.lora_A[a].weight.requires_grad or w.lora_B[a].weight.requires_grad):
                    return "autograd is recording (LoRA weights require grad)", None
                v = lv.view(torch, a)
                if isinstance(v, str):
                    return v, None
                s = float(w.scaling[a])
                if not abs(s) < F32_OVERFLOW:  # PEFT's own forward gives inf/nan then
                    return f"adapter {a!r} scaling {s!r} is not finite in float32", None
                v.scale.set(s)
                views.append(v)
            if mixed:
                slot = {a: i for i, a in enumerate(names)}
                seq = torch.tensor([slot.get(a, -1) for a in adapter_names], dtype=torch.int64)
                per_level[lv.role] = (lv.table(views), seq)
            else:
                per_level[lv.role] = views
        return None, (hidden, ids, weights, per_level)

    def _bind(self, x, args, kwargs):
        """(hidden, ids, weights) from the experts' call, or None for any other argument."""
        if len(args) == 2 and (not kwargs or (len(kwargs) == 1 and "adapter_names" in kwargs)):
            return x, args[0], args[1]
        given = dict(zip(self.names[1:], args))
        if len(args) > 2:
            return None
        for key, value in kwargs.items():
            if key == "adapter_names":
                continue
            if key not in self.names[1:] or key in given:
                return None
            given[key] = value
        if len(given) != 2:
            return None
        return x, given[self.names[1]], given[self.names[2]]

    def _experts_forward(self, hidden, top_ids, top_weights, per_level, adapter_names):
        torch = self.torch
        ex = self.experts
        n_tokens, k = top_ids.shape
        flat = top_ids.reshape(-1).to(torch.int64)
        ids_g, perm = torch.sort(flat, stable=True)
        tok = torch.div(perm, k, rounding_mode="floor")
        x_g = hidden.index_select(0, tok)
        seq_g = None
        if adapter_names is not None:  # per-slot sequence of each sorted pair
            seq_g = torch.div(tok, n_tokens // len(adapter_names), rounding_mode="floor")
        up = "gate_up_proj" if ex.has_gate else "up_proj"
        w_up = getattr(ex, up)
        n_experts = w_up.shape[0]
        counts = torch.bincount(ids_g, minlength=n_experts)
        if counts.numel() != n_experts:
            raise IndexError(f"an expert id is out of range [0, {n_experts}): "
                             f"{int(flat.max())}")
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = self._linear(x_g.to(w_up.dtype), w_up, offs, counts)
        if ex.has_bias:
            h.add_(getattr(ex, up + "_bias").index_select(0, ids_g))
        self._lora(per_level.get("up"), x_g, h, ids_g, seq_g)
        h = ex._apply_gate(h) if ex.has_gate else ex.act_fn(h)
        w_down = ex.down_proj
        d = self._linear(h.to(w_down.dtype), w_down, offs, counts)
        if ex.has_bias:
            d.add_(ex.down_proj_bias.index_select(0, ids_g))
        self._lora(per_level.get("down"), h, d, ids_g, seq_g)
        if ex.has_post_expert_norm:
            d = ex.post_expert_norm(d)
        d = d * top_weights.reshape(-1).index_select(0, perm).unsqueeze(-1)
        out = torch.empty_like(d).index_copy_(0, perm, d)
        return out.view(n_tokens, k, -1).sum(dim=1).to(hidden.dtype)

    def _linear(self, x, w, offs, counts):
        """x [S, in] sorted by expert @ each pair's expert of w ([E, out, in], or [E, in, out]
        when transposed): torch's grouped_mm where it takes the operands, else one mm per
        routed expert."""
        torch = self.torch
        wt = w if self.experts.is_transposed else w.transpose(-2, -1)  # [E, in, out]
        if self.grouped and _grouped_ok(x, wt):
            return torch.nn.functional.grouped_mm(x, wt, offs=offs)
        out = torch.empty((x.shape[0], wt.shape[2]), dtype=x.dtype)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                torch.mm(x[start:start + n], wt[e], out=out[start:start + n])
                start += n
        return out

    def _lora(self, terms, x, out, ids_g, seq_g):
        if not terms:
            return
        if x.dtype != out.dtype or not x.is_contiguous():
            x = x.contiguous()
        if seq_g is None:
            for experts in terms:
                experts.add_to(x, out, ids_g)
            return
        table, seq = terms
        table.apply_experts(x, out, ids_g, seq.index_select(0, seq_g))


def _grouped_ok(x, wt):
    """torch's CPU grouped_mm takes operands whose strides (bytes) and addresses are multiples
    of 16."""
    isz = x.element_size()
    return (x.data_ptr() % 16 == 0 and wt.data_ptr() % 16 == 0
            and all((s * isz) % 16 == 0 for s in x.stride() if s != 1)
            and all((s * isz) % 16 == 0 for s in wt.stride() if s != 1))
