"""`accelerate_peft` for PEFT's LoRA ``Linear`` and ``Embedding`` layers (aLoRA and DoRA included).

A served layer computes PEFT's forward with the LoRA term from this library's kernels: the base
layer by torch, then one entry-table call per layer (the active adapters as one stack, a mixed
batch's adapters as a bank), reading PEFT's own ``lora_A`` / ``lora_B`` tensors in place through
`LoraDelta.view`.  The layer's ``scaling``, active adapters, merge state and ``adapter_names`` /
aLoRA offsets are read at every call, as PEFT reads them; after the first call of a plain
configuration, `Plan` keeps a short path valid while nothing it depends on moves.

A DoRA adapter (``use_dora``) is a `DoraDelta` over the same views, its base statistics made
from the base layer's weight and rebuilt when the weight, ``lora_A``, ``lora_B`` or the
magnitude moved or changed (data pointer or version counter: in-place changes, ``.data``
replacements; a raw write into ``.data`` needs ``acc.refresh()``).  Its row factor applies to
the bias-free output, as PEFT's does: a Linear layer's bias is taken out of the base result
before the DoRA terms and put back after.
"""

import numpy as np

from .. import _arrays as arrays
from .. import _dtypes as dtypes
from .. import _edge
from .. import _torch as torchs
from .._entries import EntryTable
from ..kinds.delta import LoraDelta
from ..kinds.dora import DoraDelta
from ..kinds.stack import LoraStack
from ..scale import F32_OVERFLOW, LoraScale
from ._torch_ops import compiling as _compiling, eager as _eager, term as _op
from .accelerate import ServedLayer, hook_reason, version

__all__ = ["Kind", "Layer", "Plan"]

_CALLED = ("lora_dropout", "lora_A", "lora_B")  # the ModuleDicts a Linear's forward calls into
_plan_run = _edge.plan_run
_plan_holds = _edge.plan_holds
_CODE_PAIRS = {}  # (A dtype code, B dtype code) tuples, shared by every plan


def _key(ta, tb):
    """What a view of A and B over their memory depends on: memory, dtypes, shapes, strides."""
    return (ta.data_ptr(), tb.data_ptr(), ta.dtype, tb.dtype, tuple(ta.shape), tuple(tb.shape),
            ta.stride(), tb.stride())


def _writable(result, x, base, g):
    """The base layer's result as the kernels may add into it in place: as it is, or a fresh
    contiguous copy, which the layer then returns (PEFT's ``result + lora`` is a new tensor too),
    when it is a lazily negated view (its memory holds the negated values), has a layout the
    kernels do not write (a last axis that is not contiguous, leading axes that do not collapse
    into rows), shares memory with x (a base layer returning its input), or when forward hooks
    on the base layer (or global ones: `g`, torch's module globals) may have kept it: their
    tensor stays the base layer's output."""
    if result.dim() and (result.is_neg()
                         or arrays.out_layout(tuple(result.shape), result.stride()) is None
                         or base._forward_hooks or g._global_forward_hooks
                         or (isinstance(x, type(result)) and x.numel() and result.numel()
                             and x.untyped_storage().data_ptr()
                             == result.untyped_storage().data_ptr())):
        fresh = result.resolve_neg()  # a copy when result has the neg bit, else result itself
        if fresh is not result:
            return fresh.contiguous()
        return result.clone() if result.is_contiguous() else result.contiguous()
    return result


def _in_place(result, fresh):
    """An output as PEFT's in-place rules leave it (a mixed batch's rows, aLoRA's positions):
    PEFT adds them into the base layer's output itself, so a tensor a hook on the base layer
    kept, or x when the base layer returned it, holds them too.  When the term went into a
    copy (`fresh`, see `_writable`), it is written back into `result`, which is returned (PEFT
    reads each adapter's rows of x before it writes them, and they do not overlap); except for
    a result whose elements share memory (an expanded view), which cannot take it: the copy."""
    if fresh is result or any(st == 0 and n > 1 for st, n in zip(result.stride(), result.shape)):
        return fresh
    result.copy_(fresh)
    return result


class Kind:
    """PEFT's plain LoRA ``Linear`` and ``Embedding`` layers (aLoRA included), for one
    `PeftAcceleration`: the PEFT types, which modules it serves, and why one cannot be served."""

    def __init__(self, acc):
        from peft.tuners.lora import layer as lora_layer

        try:
            from peft.tuners.lora.variants import ALoraLinearVariant
        except ImportError:  # a PEFT without aLoRA
            ALoraLinearVariant = ()
        try:
            from peft.tuners.lora.variants import DoraEmbeddingVariant, DoraLinearVariant
        except ImportError:  # a PEFT without variants: DoRA has no variant object there
            DoraEmbeddingVariant = DoraLinearVariant = ()
        try:
            from peft.tuners.lora.dora import DoraEmbeddingLayer, DoraLinearLayer
            self.magnitudes = {True: (DoraLinearLayer,), False: (DoraEmbeddingLayer,)}
        except ImportError:  # pragma: no cover - a PEFT without DoRA
            self.magnitudes = {True: (), False: ()}
        nn = acc._torch.nn
        self.factor_type, self.dropout_types = nn.Linear, (nn.Dropout, nn.Identity)
        self.acc = acc
        self.linear, self.embedding = lora_layer.Linear, lora_layer.Embedding
        self.alora = ALoraLinearVariant
        self.dora = (DoraLinearVariant, DoraEmbeddingVariant)

    def layer(self, name, module):
        """A served `Layer` patched over `module` when it is of this kind, else None."""
        if type(module) in (self.linear, self.embedding):
            return Layer(self, name, module)
        return None

    def reason(self, module, names=None):
        """Why `module` cannot be served for the adapters `names` (None: every adapter it
        holds), or None.  Static reasons only (the configuration); the per-call ones are in
        Layer.reason."""
        linear = type(module) is self.linear
        adapters = names if names is not None else (
            list(module.lora_A) if linear else list(module.lora_embedding_A))
        for a in adapters:
            dora = module.use_dora.get(a, False)
            if dora:
                dora_layer = module.lora_magnitude_vector[a]
                embed_scale = getattr(module, "_get_embed_scale", None)
                if not linear and embed_scale is not None and embed_scale() is not None:
                    return f"adapter {a!r} uses DoRA on an embedding that scales its output"
                if linear and bool(getattr(dora_layer, "fan_in_fan_out", False)) != bool(
                        module.fan_in_fan_out):
                    return f"adapter {a!r}: its DoRA layer's fan_in_fan_out is not the layer's"
            if module.lora_bias.get(a, False):
                return f"adapter {a!r} has a lora_bias"
            variant = module.lora_variant.get(a)
            if variant is not None and not (linear and self.alora
                                            and isinstance(variant, self.alora)) \
                    and not (dora and isinstance(variant, self.dora)):
                return f"adapter {a!r} is a {type(variant).__name__} variant"
        if not linear:
            if getattr(module, "input_fns", None) or getattr(module, "output_fns", None):
                return "the embedding has tensor-parallel input/output hooks"
            if getattr(module.get_base_layer(), "max_norm", None) is not None:
                return "the embedding renormalises rows (max_norm)"
        return None


class Layer(ServedLayer):
    """One patched PEFT LoRA Linear or Embedding layer: views of its adapters' weights, the
    entry tables over them, and the short path for the next call."""

    __slots__ = ("kind", "linear", "views", "doras", "tables", "plan", "mixed")

    def __init__(self, kind, name, module):
        self.kind = kind
        self.linear = type(module) is kind.linear
        self.views = {}   # adapter -> (key, LoraDelta view)
        self.doras = {}   # DoRA adapter -> (key, DoraDelta over its view)
        self.tables = {}  # tuple of view ids -> (EntryTable, views kept alive)
        self.plan = None  # the short path for the next call, while nothing it depends on moves
        self.mixed = {}   # (tuple(adapter_names), x's axes) -> that mixed batch's short path
        super().__init__(kind.acc, name, module)

    def static_reason(self):
        return self.kind.reason(self.module)

    def refresh(self):
        self.views.clear()
        self.doras.clear()
        self.tables.clear()
        self.plan = None
        self.mixed.clear()

    def unpatch(self):
        self.plan = None
        self.mixed.clear()
        super().unpatch()
        self.views.clear()
        self.doras.clear()
        self.tables.clear()

    # ------------------------------------------------------------------ weights
    def _adapter_tensors(self, a):
        """(A tensor, B tensor) as PEFT holds them: Linear lora_A [r, in], lora_B [out, r];
        Embedding lora_embedding_A [r, vocab], lora_embedding_B [dim, r]."""
        m = self.module
        if self.linear:
            return m.lora_A[a].weight, m.lora_B[a].weight
        return m.lora_embedding_A[a], m.lora_embedding_B[a]

    def view(self, a):
        """A LoraDelta over adapter `a`'s tensors where they are (rebuilt when they moved), a
        DoraDelta over that view for a DoRA adapter, or a reason string when they cannot be read
        in place."""
        ta, tb = self._adapter_tensors(a)
        key = _key(ta, tb)
        got = self.views.get(a)
        if got is not None and got[0] == key:
            delta = got[1]
        else:
            delta = self._make_view(a, ta, tb)
            if isinstance(delta, str):
                return delta
            self.views[a] = (key, delta)
            self.tables.clear()  # tables over the old view would keep its memory alive
        if not self.module.use_dora.get(a, False):
            return delta
        return self._dora(a, delta, ta, tb)

    def _dora(self, a, view, ta, tb):
        """The DoraDelta of DoRA adapter `a` over its view, its statistics rebuilt when the base
        weight, A, B or the magnitude moved or changed (data pointer, version counter)."""
        m = self.module
        w = m.get_base_layer().weight
        mag = m.lora_magnitude_vector[a].weight
        key = (id(view),) + tuple((t.data_ptr(), version(t), tuple(t.shape), t.stride(), t.dtype)
                                  for t in (w, mag, ta, tb))
        got = self.doras.get(a)
        if got is not None and got[0] == key:
            return got[1]
        if dtypes.torch_codes().get(w.dtype) is None or not w.is_cpu:
            return f"adapter {a!r}: the base weight is {w.dtype} on {w.device}"
        base = w.T if (self.linear and m.fan_in_fan_out) else w
        try:
            dora = DoraDelta._over(view, mag.detach(), base.detach(), not self.linear)
        except ValueError as exc:  # a zero-norm row: PEFT's own forward gives inf / nan there
            return f"adapter {a!r}: {exc}"
        self.doras[a] = (key, dora)
        self.tables.clear()
        return dora

    def _make_view(self, a, ta, tb):
        name = dtypes.NAME_OF.get(dtypes.torch_codes().get(ta.dtype))
        if name is None or tb.dtype != ta.dtype:
            return f"adapter {a!r} weights are {ta.dtype}/{tb.dtype}"
        if not (ta.is_cpu and tb.is_cpu):
            return f"adapter {a!r} weights are on {ta.device}"
        sa, sb = ta.stride(), tb.stride()
        scale = LoraScale(0.0)
        if self.linear:  # A [r, in] rows; B [out, r] rows (or B^T rows when stored transposed)
            rank, cols = ta.shape
            rows = tb.shape[0]
            if sa[1] != 1 and cols > 1:
                return f"adapter {a!r} lora_A is not row-contiguous"
            if sb[1] == 1 or rank == 1:
                b, b_by_row = (tb.data_ptr(), sb[0] if rows > 1 else rank), True
            elif sb[0] == 1:
                b, b_by_row = (tb.data_ptr(), sb[1]), False
            else:
                return f"adapter {a!r} lora_B is not contiguous in either axis"
            return LoraDelta.view((ta.data_ptr(), sa[0] if rank > 1 else cols), b, dtype=name,
                                  rank=rank, rows=rows, cols=cols, b_by_row=b_by_row,
                                  scale=scale, keep=(ta.detach(), tb.detach()))
        # embedding: lora_embedding_A [r, vocab] is B^T rows; lora_embedding_B [dim, r] is A^T rows
        rank, rows = ta.shape
        cols = tb.shape[0]
        if (sa[1] != 1 and rows > 1) or (sb[1] != 1 and rank > 1):
            return f"adapter {a!r} embedding factors are not row-contiguous"
        return LoraDelta.view((tb.data_ptr(), sb[0] if cols > 1 else rank),
                              (ta.data_ptr(), sa[0] if rank > 1 else rows), dtype=name,
                              rank=rank, rows=rows, cols=cols, a_by_row=True, scale=scale,
                              keep=(ta.detach(), tb.detach()))

    def table(self, deltas, stacked):
        """The EntryTable for these views: one stack (active adapters summed in order) or one
        entry each (a mixed batch)."""
        key = (stacked,) + tuple(id(d) for d in deltas)
        got = self.tables.get(key)
        if got is not None:
            return got[0]
        entries = [LoraStack(deltas)] if stacked else list(deltas)
        table = EntryTable(entries, "adapter")
        if len(self.tables) > 64:  # stale combinations of moved weights: start afresh
            self.tables.clear()
        self.tables[key] = (table, deltas)
        return table

    # ------------------------------------------------------------------ forward
    def reason(self, x, names):
        """Why this call must go to PEFT's own forward, or None."""
        m = self.module
        torch = self.acc._torch
        if not isinstance(x, torch.Tensor) or not x.is_cpu:
            return "the input is not a CPU tensor"
        if not self.linear and x.dim() == 0:
            return "the input is a single index without an axis"
        base_weight = getattr(m.get_base_layer(), "weight", None)
        if base_weight is not None and dtypes.torch_codes().get(base_weight.dtype) is None:
            return f"the base layer's weight is {base_weight.dtype}"
        static = self.kind.reason(m, names)
        if static is not None:
            return static
        if torch.is_grad_enabled():
            if x.requires_grad:
                return "autograd is recording (the input requires grad)"
            for a in names:
                if any(t.requires_grad for t in self._adapter_tensors(a)) or (
                        m.use_dora.get(a, False)
                        and m.lora_magnitude_vector[a].weight.requires_grad):
                    return "autograd is recording (LoRA weights require grad)"
            if any(p.requires_grad for p in m.get_base_layer().parameters()):
                return "autograd is recording (the base layer's weights require grad)"
        # the submodules PEFT's forward calls besides the base layer (whose hooks run in ours
        # too): a Linear's dropout, lora_A and lora_B; an Embedding's factors are parameters
        parts = _CALLED if self.linear else ()
        if any(m.use_dora.get(a, False) for a in names):  # PEFT calls the DoRA layer module too
            parts = parts + ("lora_magnitude_vector",)
        hooked = hook_reason(self.acc, m, parts, names)
        if hooked is not None:
            return hooked
        changed = self.parts_reason(names)
        if changed is not None:
            return changed
        if self.linear:
            for a in names:
                drop = m.lora_dropout[a]
                if drop.training and getattr(drop, "p", 0) > 0:
                    return f"dropout is active for adapter {a!r} (training mode)"
        return None

    def skip(self, why):
        """This call goes to PEFT's forward or sum, for reason `why` (`.skipped` as of the last
        call).  The layer's short paths are dropped with it: a call they serve does not write
        the status, so one is served only after a full-path call has said the layer is."""
        self.acc._status[self.name] = why
        self.plan = None
        self.mixed.clear()

    def parts_reason(self, names):
        """Why the modules PEFT's forward calls for `names` are not the ones it made, or None.
        The kernels compute ``lora_B(lora_A(dropout(x)))`` for bias-free ``torch.nn.Linear``
        factors whose weight is a parameter, and a ``Dropout`` / ``Identity``; a bias given to
        a factor by hand (a parameter, buffer or plain attribute: ``nn.Linear`` adds any of
        them; a layer's ``lora_bias`` is refused by `Kind.reason`), a weight that is not a
        parameter, another module class, a ``forward`` set on the instance, or a DoRA
        magnitude module (a Linear's or an Embedding's) changed the same way makes PEFT's
        forward compute something else, so that call goes to PEFT."""
        m, kind = self.module, self.kind
        mods = m._modules
        for a in names:
            subs = []
            if self.linear:
                subs = [(part, mods[part]._modules.get(a), (kind.factor_type,))
                        for part in ("lora_A", "lora_B")]
                subs.append(("lora_dropout", mods["lora_dropout"]._modules.get(a),
                             kind.dropout_types))
            if m.use_dora.get(a, False):
                subs.append(("lora_magnitude_vector", mods["lora_magnitude_vector"]._modules.get(a),
                             kind.magnitudes[self.linear]))
            for part, sub, types in subs:
                if type(sub) not in types:
                    return (f"{part}[{a!r}] is a {type(sub).__name__}, not the "
                            f"{' or '.join(t.__name__ for t in types)} PEFT made")
                if "forward" in sub.__dict__:
                    return f"{part}[{a!r}] has a forward of its own (set on the instance)"
                if part in ("lora_A", "lora_B"):
                    params = sub._parameters
                    if params.get("weight") is None:
                        return f"{part}[{a!r}]'s weight is not a parameter"
                    if ("bias" not in params or params["bias"] is not None
                            or "bias" in sub.__dict__):
                        return f"{part}[{a!r}] has a bias"
        return None

    def forward(self, x, *args, **kwargs):
        if _compiling():  # torch.compile is tracing this call
            return self._traced(x, *args, **kwargs)
        if not args:
            if not kwargs:
                plan = self.plan
                if plan is not None:
                    result = plan.run(x)
                    if result is not None:
                        return result
            elif self.mixed and len(kwargs) == 1:  # PEFT's adapter_names, a batch seen before
                names = kwargs.get("adapter_names")
                if type(names) is list or type(names) is tuple:
                    try:  # a plan per composition and number of axes
                        key = (tuple(names), x.ndim)
                        plan = self.mixed.get(key)
                    except (TypeError, AttributeError):  # unhashable names, or x not a tensor:
                        plan = None                       # PEFT's forward says what it thinks
                    if plan is not None:
                        result = plan.run(x)
                        if result is not None:
                            return result
                        self.mixed.pop(key, None)  # another thread may have dropped it
        return self._forward(x, *args, **kwargs)

    def _traced(self, x, *args, **kwargs):
        """The forward as ``torch.compile`` traces it: the base layer, then the LoRA term as one
        call of the custom op (`lora._torch_ops`), which runs `term_into` with the kernels when
        the compiled graph runs.  A call with other arguments (aLoRA offsets, extra base-layer
        arguments), with adapters disabled, or on an input the op does not take goes to the
        eager forward (one graph break); under autograd, to PEFT's own forward, traced as
        PEFT's."""
        m = self.module
        torch = self.acc._torch
        names = kwargs.get("adapter_names")
        if torch.is_grad_enabled() and (
                getattr(x, "requires_grad", False)
                or any(p.requires_grad for p in m.parameters())):
            self.acc._status[self.name] = "autograd is recording (compiled: PEFT's forward)"
            return self.original(x, *args, **kwargs)
        if (self.acc._active and not args and len(kwargs) == (names is not None)
                and (names is None or (isinstance(names, (list, tuple))
                                       and all(isinstance(a, str) for a in names)))
                and isinstance(x, torch.Tensor) and x.is_cpu
                and x.dim() >= (2 if self.linear else 1) and not m.disable_adapters):
            result = m.base_layer(x)
            if result is x and names is None:  # PEFT's result + term leaves x as it was (a
                result = result.clone()         # mixed batch adds in place, into x too)
            _op(x, result, id(m), list(names) if names is not None else None)
            return result
        return _eager(self._forward, x, *args, **kwargs)

    def term_into(self, x, out, adapter_names):
        """Add this call's LoRA term into ``out``, the base layer's output for ``x``, in place:
        the eager forward's steps after its base call (the kernels, or PEFT's own sum where the
        kernels do not serve the call, with ``.skipped`` saying why).  The custom op's CPU
        implementation: what a compiled graph runs."""
        m = self.module
        if adapter_names is None:
            plan = self.plan
            base = plan.holds(x) if plan is not None else None
            if base is not None:  # the short path, after the base call
                got = plan._tail(x, out, base)
                if got is not out:
                    out.copy_(got)
                return
            self.plan = None
        else:
            self._check_args(x, (), {"adapter_names": adapter_names}, adapter_names)
        if m.disable_adapters or (m.merged and adapter_names is None):
            self.acc._status[self.name] = None  # the base layer's output is the whole result
            return
        if self.acc._active:
            names, why = self._prepare(x, adapter_names)
        else:  # restore() ran after the graph was traced: PEFT's own sum
            names, why = self._names(adapter_names), "restored"
        if why is None and names and not self.takes(x, out, names):
            why = "the base layer's output is not one the kernels add into"
        if why is not None:
            if adapter_names is not None:
                got = self.peft_mixed_tail(x, out, adapter_names, None, {})
            else:
                got = self.peft_tail(x, out, names, None, {})
            if self.acc._active:
                self.skip(why)
            if got is not out:
                out.copy_(got)
            return
        if names:
            fresh = _writable(out, x, m.base_layer, self.acc._module_globals)
            if adapter_names is not None:
                self._mixed(x, fresh, adapter_names, names, None)
            else:
                self._active(x, fresh, names, None)
                self._leave_plan(x, names)
            if fresh is not out:
                out.copy_(fresh)
        self.acc._status[self.name] = None

    def _names(self, adapter_names):
        """The adapters of this call that the layer holds, in PEFT's order: the active ones, or
        those `adapter_names` names (a mixed batch)."""
        m = self.module
        keys = m.lora_A if self.linear else m.lora_embedding_A
        if adapter_names is not None:
            return [a for a in dict.fromkeys(adapter_names) if a != "__base__" and a in keys]
        return [a for a in m.active_adapters if a in keys]

    def _prepare(self, x, adapter_names):
        """(the adapters of this call, in PEFT's order; why PEFT must compute it, or None), with
        each adapter's view (and DoRA statistics) made current and its scale set."""
        m = self.module
        keys = m.lora_A if self.linear else m.lora_embedding_A
        if len(self.views) > len(keys):  # deleted adapters: let their memory go
            for a in [a for a in self.views if a not in keys]:
                del self.views[a]
            self.tables.clear()
        names = self._names(adapter_names)
        why = self.reason(x, names) if not m.disable_adapters else None
        if why is None and names:
            views = [self.view(a) for a in names]
            why = next((v for v in views if isinstance(v, str)), None)
            if why is None:
                for a, v in zip(names, views):
                    scale = self._scale(a)
                    if not abs(scale) < F32_OVERFLOW:  # PEFT's own forward gives inf/nan then
                        why = f"adapter {a!r} scaling {scale!r} is not finite in float32"
                        break
                    v.scale.set(scale)
        return names, why

    def _forward(self, x, *args, **kwargs):
        """PEFT's forward logic with the LoRA term from the kernels; leaves a `Plan` behind for
        the common case (plain active adapters, nothing in kwargs) so the next call is short."""
        m = self.module
        acc = self.acc
        if not acc._active:  # pragma: no cover - restore() removed the patch
            return self.original(x, *args, **kwargs)
        adapter_names = kwargs.get("adapter_names")
        if adapter_names is None:  # a mixed call leaves the active adapters' plan alone
            self.plan = None
        names, why = self._prepare(x, adapter_names)
        result_dtype_ok = True
        if why is not None:
            self.skip(why)
            return self.original(x, *args, **kwargs)
        self._check_args(x, args, kwargs, adapter_names)
        kwargs.pop("adapter_names", None)
        alora_offsets = kwargs.pop("alora_offsets", None)
        if m.disable_adapters:
            if m.merged:
                m.unmerge()
            result = m.base_layer(x, *args, **kwargs)
        elif adapter_names is not None:
            result = m.base_layer(x, *args, **kwargs)
            if names and not self.takes(x, result, names):
                return self.peft_mixed_tail(x, result, adapter_names, alora_offsets, kwargs)
            base_result = result
            result = _writable(result, x, m.base_layer, acc._module_globals)
            result_dtype_ok = self._mixed(x, result, adapter_names, names, alora_offsets)
            if result_dtype_ok:
                result = _in_place(base_result, result)
            if (result_dtype_ok and names and self.linear and not args and not kwargs
                    and x.dim() > 1 and alora_offsets is None
                    and not any(self._is_alora(a) or m.use_dora.get(a, False) for a in names)):
                plan = Plan(self, names, x.dim(), adapter_names)
                if plan.ok:
                    if len(self.mixed) >= 16:  # batches of other compositions: start afresh
                        self.mixed.clear()
                    self.mixed[(tuple(adapter_names), x.dim())] = plan
        elif m.merged:
            result = m.base_layer(x, *args, **kwargs)
        else:
            result = m.base_layer(x, *args, **kwargs)
            if names and not self.takes(x, result, names):
                return self.peft_tail(x, result, names, alora_offsets, kwargs)
            base_result = result
            result = _writable(result, x, m.base_layer, acc._module_globals)
            if names:
                self._active(x, result, names, alora_offsets)
                if all(self._is_alora(a) for a in names):
                    result = _in_place(base_result, result)  # PEFT's aLoRA adds in place
                if (self.linear and x.dim() == 1
                        and any(m.use_dora.get(a, False) for a in names)):
                    result = result.unsqueeze(0)  # PEFT's DoRA term is [1, out]: it broadcasts
                if not args and not kwargs and alora_offsets is None:
                    self._leave_plan(x, names)
        if not result_dtype_ok:  # a mixed batch without adapters here, of a dtype the kernels
            # do not write: PEFT computes it
            self.skip(f"the layer's output is {result.dtype}")
            kwargs["adapter_names"] = adapter_names
            if alora_offsets is not None:
                kwargs["alora_offsets"] = alora_offsets
            return self.original(x, *args, **kwargs)
        acc._status[self.name] = None
        return result

    def _leave_plan(self, x, names):
        """After a full-path call on the active adapters `names` (no other arguments), the
        short path for the next one, when there is one: Linear layers, a batched x, no aLoRA
        adapter, no DoRA adapter on a layer with a bias."""
        m = self.module
        if (self.linear and x.dim() > 1 and not any(self._is_alora(a) for a in names)
                and not (any(m.use_dora.get(a, False) for a in names)
                         and getattr(m.get_base_layer(), "bias", None) is not None)):
            plan = Plan(self, names, x.dim())
            self.plan = plan if plan.ok else None

    def takes(self, x, result, names):
        """Whether the kernels add a Linear layer's term into the base layer's `result` (in
        place, or into the copy `_writable` makes): a tensor of a dtype they write, of the
        term's own shape (x's leading axes, the layer's outputs), that does not require grad.
        PEFT's forward adds the term out of place, so it also serves a result that broadcasts
        with the term, or requires grad (a base layer computing with tensors outside its
        parameters that do): `peft_tail` then runs PEFT's sum on it."""
        if type(result) is not self.acc._torch.Tensor or result.requires_grad:
            return False
        if dtypes.torch_codes().get(result.dtype) is None or x.dim() < 1:
            return False
        m = self.module
        shape = result.shape
        if not self.linear:  # ids [...] -> [..., dim]
            dim = m.lora_embedding_B[names[0]].shape[0]
            return len(shape) == x.dim() + 1 and shape[-1] == dim and shape[:-1] == x.shape
        rows = m._modules["lora_B"]._modules[names[0]]._parameters["weight"].shape[0]
        return (len(shape) == x.dim() and shape[-1] == rows
                and tuple(shape[:-1]) == tuple(x.shape[:-1]))

    def _peft_term(self, a, x):
        """PEFT's plain LoRA term of adapter `a` on x, with PEFT's own modules and functions."""
        m = self.module
        if self.linear:
            return m.lora_B[a](m.lora_A[a](m.lora_dropout[a](x))) * m.scaling[a]
        out = (m._embed(x, m.lora_embedding_A[a].T) @ m.lora_embedding_B[a].T) * m.scaling[a]
        embed_scale = m._get_embed_scale() if hasattr(m, "_get_embed_scale") else None
        return out if embed_scale is None else out * embed_scale.to(out.dtype)

    def peft_tail(self, x, result, names, alora_offsets, kwargs):
        """PEFT's own sum of the active adapters `names` onto a base layer's `result` that
        `takes` does not take, with PEFT's modules: for each adapter in order (a Linear
        layer's x cast to its lora_A's dtype, as PEFT casts it, once per adapter) ``result +
        term`` (`_peft_term`) for plain LoRA, or the adapter's variant (DoRA, aLoRA) on the
        result, then the result in the base result's dtype.  The base layer is not called
        again (its hooks and side effects run once)."""
        m = self.module
        self.skip("the base layer's output is not one the kernels add into")
        dtype = result.dtype
        variants = m.lora_variant
        for a in names:
            if self.linear:  # PEFT casts a Linear layer's input, not an embedding's ids
                x = m._cast_input_dtype(x, m.lora_A[a].weight.dtype)
            variant = variants.get(a)
            if variant is None:
                result = result + self._peft_term(a, x)
            else:
                result = variant.forward(m, active_adapter=a, x=x, result=result,
                                         alora_offsets=alora_offsets, **kwargs)
        return result.to(dtype)

    def peft_mixed_tail(self, x, result, adapter_names, alora_offsets, kwargs):
        """PEFT's own mixed batch on a base layer's `result` that `takes` does not take: each
        adapter named (not "__base__", held by the layer) on its rows of x (a Linear layer's
        cast to its lora_A's dtype), its term added into those rows of `result` in place (in
        `result`'s dtype for a Linear layer, as PEFT), or its variant on those rows; the base
        layer is not called again."""
        m = self.module
        self.skip("the base layer's output is not one the kernels add into")
        dtype, variants = result.dtype, m.lora_variant
        held = m.lora_A if self.linear else m.lora_embedding_A
        for a in dict.fromkeys(adapter_names):
            if a == "__base__" or a not in held:
                continue
            rows = [i for i, n in enumerate(adapter_names) if n == a]
            sub = x[rows].to(m.lora_A[a].weight.dtype) if self.linear else x[rows]
            variant = variants.get(a)
            if variant is None:
                term = self._peft_term(a, sub)
                result[rows] += term.to(dtype) if self.linear else term
            else:
                offsets = (None if alora_offsets is None
                           else [alora_offsets[j] for j in rows])
                result[rows] = variant.forward(m, active_adapter=a, x=sub, result=result[rows],
                                               alora_offsets=offsets, **kwargs).to(dtype)
        return result

    def _check_args(self, x, args, kwargs, adapter_names):
        """PEFT's checks of the forward's arguments, except its refusal of DoRA adapters in
        ``adapter_names`` (the kernels serve such mixed batches): the same length and merge
        checks, with PEFT's messages, then PEFT's own check for everything else."""
        m = self.module
        if adapter_names is None or not any(m.use_dora.get(a, False) for a in adapter_names):
            m._check_forward_args(x, *args, **kwargs)
            return
        if len(x) != len(adapter_names):
            raise ValueError(f"Length of `adapter_names` should be the same as the number of "
                             f"inputs, but got {len(adapter_names)} and {len(x)} respectively.")
        if m.merged:
            raise ValueError("Cannot pass `adapter_names` when there are merged adapters, please "
                             "call `unmerge_adapter` first.")

    def _scale(self, a):
        """PEFT's scaling of adapter `a`, read now (times an embedding's embed_scale)."""
        m = self.module
        s = float(m.scaling[a])
        if not self.linear:
            embed_scale = m._get_embed_scale() if hasattr(m, "_get_embed_scale") else None
            if embed_scale is not None:
                s *= float(embed_scale)
        return s

    def _is_alora(self, a):
        variant = self.module.lora_variant.get(a)
        return bool(self.kind.alora) and isinstance(variant, self.kind.alora)

    def _alora_ids(self, result, slot_of_row, offsets):
        """Per-position ids [B, T] for aLoRA rows: the slot on the last min(offset, T) positions
        of each row, -1 elsewhere (PEFT's rule; offset None = off)."""
        shape = tuple(result.shape)
        rows = shape[0]
        t = shape[1] if len(shape) == 3 else 1
        ids = np.full((rows, t), -1, np.int64)
        for b in range(rows):
            slot, alora = slot_of_row[b]
            if slot < 0:
                continue
            if not alora:
                ids[b, :] = slot
                continue
            off = offsets[b] if offsets is not None else None
            if off is None:
                continue
            k = min(int(off), t)
            if k > 0:
                ids[b, t - k:] = slot
        return ids if len(shape) == 3 else ids[:, 0]

    def _bias_out(self, names, result, sign):
        """A Linear layer with DoRA adapters among `names` and a bias: the bias taken out of
        (sign -1) or put back into (+1) `result`, since DoRA's row factor scales the bias-free
        output (PEFT: ``base_result - bias``).  True when it did so."""
        if not self.linear or not any(self.module.use_dora.get(a, False) for a in names):
            return False
        bias = getattr(self.module.get_base_layer(), "bias", None)
        if bias is None:
            return False
        with self.acc._torch.no_grad():
            result.add_(bias.to(result.dtype), alpha=sign)
        return True

    def _run(self, table, x, result, ids=None):
        if self.linear:
            if result.dim() == 1:
                table.apply_batch(x.unsqueeze(0), result.unsqueeze(0), ids)
            else:
                table.apply_batch(x, result, ids)
        else:
            table.apply_rows(x, result, ids)

    def _active(self, x, result, names, alora_offsets):
        """The active adapters, summed in PEFT's order into `result`, a base output `takes` took."""
        views = [self._served(a) for a in names]  # their scales were set by forward()
        alora = [self._is_alora(a) for a in names]
        if not any(alora):
            biased = self._bias_out(names, result, -1)
            self._run(self.table(views, True), x, result)
            if biased:
                self._bias_out(names, result, 1)
            return
        # aLoRA: each adapter on its own positions, in order
        for v, is_alora in zip(views, alora):
            table = self.table([v], False)
            rows = result.shape[0] if result.dim() > 1 else 1
            ids = self._alora_ids(result if result.dim() > 1 else result.unsqueeze(0),
                                  [(0, is_alora)] * rows, alora_offsets)
            if result.dim() == 1:
                self._run(table, x.unsqueeze(0), result.unsqueeze(0), ids)
            else:
                self._run(table, x, result, ids)

    def _mixed(self, x, result, adapter_names, names, alora_offsets):
        """A mixed batch (PEFT's adapter_names): one bank call, row b on its own adapter."""
        if dtypes.torch_codes().get(result.dtype) is None:
            return False
        if not names:
            return True
        slot = {a: i for i, a in enumerate(names)}
        views = [self._served(a) for a in names]
        table = self.table(views, False)
        alora = {a: self._is_alora(a) for a in names}
        per_row = [(slot.get(a, -1), alora.get(a, False)) for a in adapter_names]
        if any(alora.values()):
            ids = self._alora_ids(result, per_row, alora_offsets)
        else:
            ids = np.fromiter((s for s, _ in per_row), np.int64, len(per_row))
        # DoRA rows: the bias out and back only where a DoRA adapter runs (a plain row keeps
        # PEFT's result + term)
        dora_rows = None
        if self.linear and any(self.module.use_dora.get(a, False) for a in names):
            bias = getattr(self.module.get_base_layer(), "bias", None)
            if bias is not None:
                is_dora = np.array([self.module.use_dora.get(a, False) for a in names] + [False])
                dora_rows = np.flatnonzero(is_dora[ids.reshape(len(per_row), -1)[:, 0]])
        if dora_rows is not None and dora_rows.size:
            torch = self.acc._torch
            sel = torch.from_numpy(dora_rows)
            b = self.module.get_base_layer().bias.to(result.dtype)
            with torch.no_grad():
                result[sel] -= b
                self._run(table, x, result, ids)
                result[sel] += b
        else:
            self._run(table, x, result, ids)
        return True

    def _served(self, a):
        """What serves adapter `a` now: its DoraDelta (DoRA) or its LoraDelta view."""
        got = self.doras.get(a) if self.module.use_dora.get(a, False) else None
        return got[1] if got is not None else self.views[a][1]


class Plan:
    """A Linear layer's short path: the active adapters' stack (or one mixed batch's bank),
    valid while none of what PEFT's forward depends on has moved: the active adapters,
    disable/merge state, the adapters' modules (the same objects of the same classes, no hooks
    on them, none global, no forward set on the instance, bias-free factors) and parameters
    (and where their data lives), their scaling, training mode with dropout, autograd not
    recording for them, and the input's number of axes.  The base layer is the module's at
    each call.

    The checks run in C, once (``lora._edge.plan_run``, csrc/python/edge_peft.h), in the
    order of the full path's: anything moved, or an x it does not take, declines the call
    before the base layer runs (``run`` answers None and the layer's full path takes the call,
    and may leave a new plan); a base result the kernels do not take in place, or a C refusal,
    goes to `_tail`.  What cannot change while the plan holds is read once, here: the table's
    view and scales (the views' scales are set only by the full path, which drops the plan
    first), the dtype codes.

    DoRA adapters (on a layer without a bias) are members with a row-factor epilogue; the plan
    also holds while the base weight, the magnitudes, A and B keep their objects, data and
    version counters (what their statistics were made from), which `_held` checks, called from
    C.  A mixed plan (``adapter_names``: one PEFT mixed batch, row b on its own adapter) holds
    the same while the batch's composition is the same: the entry table of its adapters, one id
    per row, and the names it lacks (still absent from the layer)."""

    __slots__ = ("layer", "module", "active", "names", "params", "keys", "scalings", "table",
                 "grad_enabled", "ok", "dora", "hooks", "c", "ids", "adapter_names")

    def __init__(self, layer, names, ndim, adapter_names=None):
        m = layer.module
        self.layer, self.module = layer, m
        torch = layer.acc._torch
        self.grad_enabled = torch.is_grad_enabled
        codes = torchs.TORCH_CODES or torchs.torch_init()
        # What the plan checks is read here, once, from the live state, which another thread
        # may change meanwhile: the plan is kept (``ok``) only when what it read agrees with
        # itself (the adapters with the active value, the views with the tensors, the scales
        # in the C call with the scaling).
        active = m.__dict__.get("_active_adapter")
        self.active = list(active) if isinstance(active, list) else active  # PEFT keeps the
        self.names = tuple(names)                                            # caller's list
        lora_a, lora_b = m._modules["lora_A"]._modules, m._modules["lora_B"]._modules
        drops = m._modules["lora_dropout"]._modules
        mods = tuple((lora_a[a], lora_b[a], drops[a]) for a in names)
        types = tuple(tuple(type(mod) for mod in ms) for ms in mods)
        self.params = tuple((ma._parameters["weight"], mb._parameters["weight"])
                            for ma, mb, _ in mods)
        self.scalings = tuple(m.scaling[a] for a in names)
        pairs = [layer.views.get(a) for a in names]  # (key, view): one read each
        self.keys = tuple(p[0] if p is not None else None for p in pairs)
        held = [a for a in ([self.active] if isinstance(self.active, str) else self.active or ())
                if a in lora_a] if adapter_names is None else [
            a for a in dict.fromkeys(adapter_names) if a != "__base__" and a in lora_a]
        self.ok = (held == list(names) and None not in pairs
                   and all(k == _key(pa, pb) for k, (pa, pb) in zip(self.keys, self.params)))
        views = [layer._served(a) if m.use_dora.get(a, False) else p[1]
                 for a, p in zip(names, pairs)] if self.ok else [layer._served(a) for a in names]
        table = self.table = layer.table(views, adapter_names is None)
        self.ids, absent = None, ()
        self.adapter_names = tuple(adapter_names) if adapter_names is not None else None
        if adapter_names is not None:  # row b's entry, -1 for "__base__" and names not held
            slot = {a: i for i, a in enumerate(names)}
            self.ids = np.fromiter((slot.get(a, -1) for a in adapter_names), np.int64,
                                   len(adapter_names))
            absent = tuple(a for a in dict.fromkeys(adapter_names) if a not in slot)
        # DoRA: (name, magnitude module, the tensors with their data pointers and versions)
        weight = m._modules["base_layer"]._parameters.get("weight")
        watch = []
        for a, (pa, pb) in zip(names, self.params):
            if m.use_dora.get(a, False):
                mag = m.lora_magnitude_vector[a]
                ts = (weight, mag._parameters["weight"], pa, pb)
                watch.append((a, mag, type(mag), ts,
                              tuple((t.data_ptr(), version(t)) for t in ts)))
        self.dora = tuple(watch)
        self.hooks = layer.acc._module_globals
        try:
            scales = table.scales()
        except ValueError:  # a DoRA row factor that cannot be made: the full path says so
            self.ok, scales = False, None
        self.ok = self.ok and table.edge_view() is not None and [
            scales[i] for i in range(len(names))] == [float(v) for v in self.scalings]
        self.c = None  # plan_run's tuple (the fields of csrc/python/edge_peft.h, in order)
        if self.ok:
            code_pairs = tuple(_CODE_PAIRS.setdefault((codes[k[2]], codes[k[3]]),
                                                      (codes[k[2]], codes[k[3]]))
                               for k in self.keys)
            self.c = (m, self.active, self.names, mods, self.params, self.keys, code_pairs,
                      self.scalings, ndim, self.hooks, table.edge_view(), table.edge_scales(),
                      self.ids, absent, table, types, self._held if self.dora else None)

    def run(self, x):
        """The layer's output, or None: the full path takes the call."""
        got = _plan_run(self.c, x)
        if type(got) is tuple:
            return self._tail(x, got[0], got[1])
        return got

    def holds(self, x):
        """The base layer, when this (active adapters') plan serves a call on x now: the short
        path's checks, in C, made before the base call (and without it); else None."""
        return _plan_holds(self.c, x) if self.c is not None and self.ids is None else None

    def _held(self):
        """Whether what the DoRA statistics were made from is still what they read: the
        magnitude modules (the same objects of the same classes, no hooks on them, no forward
        set on the instance) and the base weight, magnitudes, A and B (objects, data pointers,
        version counters); and in grad mode, magnitudes that do not require grad."""
        m = self.module
        mags = m._modules["lora_magnitude_vector"]._modules
        weight = m._modules["base_layer"]._parameters.get("weight")
        grad = self.grad_enabled()
        for a, mag, tym, ts, seen in self.dora:
            if (mags.get(a) is not mag or type(mag) is not tym or "forward" in mag.__dict__
                    or ts[0] is not weight or mag._parameters.get("weight") is not ts[1]
                    or mag._forward_hooks or mag._forward_pre_hooks
                    or any((t.data_ptr(), version(t)) != v for t, v in zip(ts, seen))
                    or (grad and ts[1].requires_grad)):
                return False
        return True

    def _tail(self, x, result, base):
        """After the base call: the LoRA term into `result` (the base layer's output) through
        the table's call, edge first; a result the kernels do not take gets PEFT's own sum
        (`Layer.peft_tail`, `peft_mixed_tail`)."""
        layer = self.layer
        if (torchs.TORCH_CODES.get(getattr(result, "dtype", None)) is None
                or not layer.takes(x, result, self.names)):
            return self._peft(x, result)
        fresh = _writable(result, x, base, self.hooks)
        self.table.apply_batch(x, fresh, self.ids)
        return fresh if self.ids is None else _in_place(result, fresh)

    def _peft(self, x, result):
        """PEFT's own sum on a base result the kernels do not take (`Layer.takes`).  The layer
        then reports why (`.skipped`) and drops its plans (`Layer.skip`), so that the next call
        takes the full path, which reports the layer served again when it is."""
        if self.adapter_names is not None:
            return self.layer.peft_mixed_tail(x, result, self.adapter_names, None, {})
        return self.layer.peft_tail(x, result, self.names, None, {})
