"""A served PEFT LoRA ``Linear`` or ``Embedding`` layer (aLoRA and DoRA included): its full path.

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

from .. import _dtypes as dtypes
from .._entries import EntryTable
from ..kinds.delta import LoraDelta
from ..kinds.dora import DoraDelta
from ..kinds.stack import LoraStack
from ..scale import F32_OVERFLOW, LoraScale
from .lora_plan import Plan, view_key
from .lora_rules import PeftRules, in_place, writable
from .served import ServedLayer, version
from .torch_op import compiling as _compiling, eager as _eager, term as _op

__all__ = ["Layer"]


class Layer(PeftRules, ServedLayer):
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
        key = view_key(ta, tb)
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
    def skip(self, why):
        """This call goes to PEFT's forward or sum, for reason `why` (`.skipped` as of the last
        call).  The layer's short paths are dropped with it: a call they serve does not write
        the status, so one is served only after a full-path call has said the layer is."""
        self.acc._status[self.name] = why
        self.plan = None
        self.mixed.clear()

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
        call of the custom op (`torch_op`), which runs `term_into` with the kernels when
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
            fresh = writable(out, x, m.base_layer, self.acc._module_globals)
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
            result = writable(result, x, m.base_layer, acc._module_globals)
            result_dtype_ok = self._mixed(x, result, adapter_names, names, alora_offsets)
            if result_dtype_ok:
                result = in_place(base_result, result)
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
            result = writable(result, x, m.base_layer, acc._module_globals)
            if names:
                self._active(x, result, names, alora_offsets)
                if all(self._is_alora(a) for a in names):
                    result = in_place(base_result, result)  # PEFT's aLoRA adds in place
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
