"""PEFT's rules for its LoRA ``Linear`` and ``Embedding`` layers, as `accelerate_peft` keeps
them: why a call must go to PEFT's own forward (autograd, hooks, modules PEFT did not make,
dropout), PEFT's checks of the forward's arguments, which base outputs the kernels add into
(`takes`, `_writable`, `_in_place`: PEFT's in-place and out-of-place sums), and PEFT's own sum
where the kernels do not serve the call (`peft_tail`, `peft_mixed_tail`)."""

from .. import _dtypes as dtypes
from .. import _arrays as arrays
from .served import hook_reason

__all__ = ["PeftRules"]

_CALLED = ("lora_dropout", "lora_A", "lora_B")  # the ModuleDicts a Linear's forward calls into


def writable(result, x, base, g):
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


def in_place(result, fresh):
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


class PeftRules:
    """The part of a served LoRA layer (`lora_layer.Layer`) that is PEFT's rules: it reads the
    layer's ``module``, ``kind``, ``linear`` and ``acc``."""

    __slots__ = ()

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
