"""A served PEFT LoRA Linear layer's short path (`Plan`): what the full path read once, and the
checks that it still holds, which run in C (``lora._edge.plan_run`` / ``plan_holds``)."""

import numpy as np

from .. import _edge
from .. import _torch as torchs
from .lora_rules import in_place, writable
from .served import version

__all__ = ["Plan", "view_key"]

_plan_run = _edge.plan_run
_plan_holds = _edge.plan_holds
_CODE_PAIRS = {}  # (A dtype code, B dtype code) tuples, shared by every plan


def view_key(ta, tb):
    """What a view of A and B over their memory depends on: memory, dtypes, shapes, strides."""
    return (ta.data_ptr(), tb.data_ptr(), ta.dtype, tb.dtype, tuple(ta.shape), tuple(tb.shape),
            ta.stride(), tb.stride())


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
                   and all(k == view_key(pa, pb) for k, (pa, pb) in zip(self.keys, self.params)))
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
        fresh = writable(result, x, base, self.hooks)
        self.table.apply_batch(x, fresh, self.ids)
        return fresh if self.ids is None else in_place(result, fresh)

    def _peft(self, x, result):
        """PEFT's own sum on a base result the kernels do not take (`Layer.takes`).  The layer
        then reports why (`.skipped`) and drops its plans (`Layer.skip`), so that the next call
        takes the full path, which reports the layer served again when it is."""
        if self.adapter_names is not None:
            return self.layer.peft_mixed_tail(x, result, self.adapter_names, None, {})
        return self.layer.peft_tail(x, result, self.names, None, {})
