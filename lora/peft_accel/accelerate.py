"""`accelerate_peft`: lora-kernels under a Hugging Face PEFT model, with PEFT's API unchanged.

Every PEFT LoRA ``Linear`` and ``Embedding`` layer of the model gets a forward that computes the
LoRA term with this library's kernels whenever autograd is not recording for it and dropout is
inactive, and otherwise calls PEFT's own forward (training, ``lora_bias``, other tuners).
The kernels read PEFT's own ``lora_A`` / ``lora_B`` tensors where they are (views, no copies),
so any change of the weights, however made, is seen at the next call; the layer's ``scaling``,
active adapters, merge state and ``adapter_names`` / aLoRA offsets are read at every call, as
PEFT reads them.

This module is the model level: scanning the model for the layers it serves (again at a forward
after adapters were added), patching their ``forward``, the status (``accelerated`` /
``skipped``) and ``restore()``.  Each layer kind is served by modules of its own
(`lora_kind`, `lora_layer`, `lora_plan`, `lora_rules`: PEFT's LoRA Linear and Embedding layers;
`experts`: PEFT's ``ParamWrapper`` on transformers' MoE experts), whose layers derive from
`served.ServedLayer`; `_layer_kinds` lists them.

torch and peft are imported here, on first use; ``import lora`` imports neither.
"""

import weakref

from .served import ACCELERATED as _ACCELERATED

__all__ = ["accelerate_peft", "PeftAcceleration"]

class _Rescan:
    """The pre-forward hook that patches LoRA layers added after accelerate_peft; copies of the
    model get a hook that does nothing."""

    __slots__ = ("acc",)

    def __init__(self, acc):
        self.acc = weakref.ref(acc)

    def __call__(self, module, args):
        acc = self.acc()
        if acc is not None:
            acc._rescan_hook(module, args)

    def __reduce__(self):
        return (_no_rescan, ())


def _no_rescan():
    return _noop_hook


def _noop_hook(module, args):
    return None


def accelerate_peft(model):
    """Put lora-kernels under every PEFT LoRA ``Linear`` and ``Embedding`` layer of ``model``.

    ``model``: a ``peft.PeftModel``, or any ``torch.nn.Module`` holding PEFT LoRA layers.
    Needs torch and PEFT (``pip install "lora-kernels[peft]"``; an ``ImportError`` saying so
    without them).  Returns a ``PeftAcceleration``: ``.restore()`` puts PEFT's own forward back
    (also on leaving ``with lora.accelerate_peft(model): ...``); ``.accelerated`` lists the
    layers the kernels serve and ``.skipped`` maps the others to the reason (as of the last
    forward; before any forward, as of this call); ``.refresh()`` forgets anything derived from
    the weights.

    PEFT LoRA on MoE experts (``target_parameters``: PEFT's ``ParamWrapper`` on an experts module
    of transformers' experts interface) is served by an experts forward of lora-kernels' own,
    the LoRA term for the routed pairs only; ``.extra_bytes`` is what that keeps (each experts
    adapter's ``lora_B``, repacked), and a raw ``.data`` write to such a ``lora_B`` needs
    ``.refresh()``.

    A layer is served while autograd is not recording for it (input, LoRA weights and base layer
    weights all frozen, or grad disabled), dropout is inactive, no forward hook or pre-hook is
    registered on the submodules PEFT's forward calls (``lora_A`` / ``lora_B`` /
    ``lora_dropout`` entries; nor a global module hook), and its adapters are plain LoRA, aLoRA
    or DoRA on CPU float32/float16/bfloat16 tensors; otherwise (training, ``lora_bias``, other
    variants and tuners, activation capture) PEFT's own forward runs for the whole layer, and
    ``skipped`` says why.  Hooks on the layer itself and on its ``base_layer`` run either way.
    The layer's ``base_layer`` is the one it holds at each call (it may be replaced).  DoRA
    layers keep float64 statistics of their base weight, rebuilt when the weight, ``lora_A``,
    ``lora_B`` or the magnitude changes (through the parameters; a raw write into ``.data``
    needs ``refresh()``), and also serve mixed ``adapter_names`` batches of DoRA and plain
    adapters, which PEFT's own forward refuses.
    PEFT's API keeps its meaning: active adapters, ``adapter_names``, aLoRA offsets,
    ``disable_adapter``, merges, ``scaling`` changes and weight changes are read at every call.

    The LoRA term is computed in float32 from PEFT's tensors as they are stored (read in place, no
    copies) and rounded once into the layer's output dtype.  ``torch.compile`` of the model
    keeps the kernels: a served layer traces as its base layer and one call of the custom op
    ``lora_kernels::peft_lora_term`` (MoE experts and aLoRA calls: one graph break each).
    ``TypeError`` for something that is not a ``torch.nn.Module``; ``ValueError`` for a model
    without any PEFT LoRA ``Linear`` / ``Embedding`` layer, or one already accelerated
    (``restore()`` it first).
    """
    return PeftAcceleration(model)


class PeftAcceleration:
    """What ``accelerate_peft`` returns: ``accelerated`` (list of module names), ``skipped``
    (``{module name: reason}``), ``refresh()``, ``restore()``, and a context manager that
    restores on exit.  Built only by ``accelerate_peft``."""

    def __init__(self, model):
        try:
            import torch
            from peft.tuners.lora import layer as lora_layer
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError as exc:
            raise ImportError(f"accelerate_peft needs torch and PEFT (with transformers), the "
                              f"'peft' extra: pip install \"lora-kernels[peft]\" ({exc})") from exc

        self._torch = torch
        self._module_globals = torch.nn.modules.module  # where torch keeps global module hooks
        self._lora_layer_type = lora_layer.LoraLayer
        self._tuner_layer_type = BaseTunerLayer
        self._kinds = _layer_kinds(self)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"accelerate_peft needs a torch.nn.Module (a peft.PeftModel); got "
                            f"{type(model).__name__}")
        current = _ACCELERATED.get(model)
        if current is not None and current._active:
            raise ValueError("this model is already accelerated by lora-kernels; call restore() "
                             "on the first accelerate_peft() before accelerating it again")
        self._model_ref = weakref.ref(model)
        self._layers = {}  # id(module) -> its ServedLayer
        self._covered = weakref.WeakSet()  # inner modules a served layer answers for
        self._status = {}  # module name -> None (accelerated) or the reason it is skipped
        self._active = True
        self._fingerprint = None  # what the last scan saw: the adapters and the layers served
        self._hooks = []
        self._rescan(model)
        if not self._layers:
            self._active = False
            raise ValueError("accelerate_peft: the model has no PEFT LoRA Linear or Embedding "
                             "layer" + (f" (skipped: {self.skipped})" if self._status else ""))
        # layers that appear later (add_adapter on a new target) are patched at the next forward:
        # the root and the inner model PEFT's generate calls both get a cheap pre-hook
        roots = [model]
        inner = getattr(getattr(model, "base_model", None), "model", None)
        if isinstance(inner, torch.nn.Module) and inner is not model:
            roots.append(inner)
        for root in roots:
            self._hooks.append(root.register_forward_pre_hook(_Rescan(self)))
        _ACCELERATED[model] = self

    # ------------------------------------------------------------------ public
    @property
    def accelerated(self):
        """Names (as ``model.named_modules()`` gives them) of the layers lora-kernels serves."""
        return [name for name, why in self._status.items() if why is None]

    @property
    def skipped(self):
        """``{module name: reason}`` for the LoRA layers left to PEFT's own forward."""
        return {name: why for name, why in self._status.items() if why is not None}

    @property
    def extra_bytes(self):
        """Bytes lora-kernels holds beyond PEFT's own tensors: the repacked copies of MoE
        experts' ``lora_B`` (PEFT interleaves the experts there); 0 for every other layer."""
        return sum(layer.extra_bytes() for layer in self._layers.values())

    def refresh(self):
        """Forget every view of the weights (and DoRA's base statistics); the next call builds
        them again.  Needed only after a raw ``.data`` write to a MoE experts' ``lora_B`` (its
        repacked copy is keyed on the version counter and the data pointer, which such a write
        moves neither of; PEFT's hotswap is seen without it), or to a DoRA layer's base weight,
        ``lora_A`` / ``lora_B`` or magnitude (its statistics are keyed the same way), and after
        an in-place write to such a tensor when it is an inference tensor (made under
        ``torch.inference_mode()``: it has no version counter).  Other changes made through the
        parameters (in place, through ``.data``, or by replacing them) are seen at the next call
        anyway."""
        for layer in self._layers.values():
            layer.refresh()

    def restore(self):
        """Put back exactly the forwards that were there; a second call does nothing."""
        if not self._active:
            return
        self._active = False
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for layer in self._layers.values():
            layer.unpatch()
        self._layers.clear()
        self._covered = weakref.WeakSet()
        model = self._model_ref()
        if model is not None and _ACCELERATED.get(model) is self:
            del _ACCELERATED[model]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False

    def __repr__(self):
        return (f"<lora.accelerate_peft: {len(self.accelerated)} layers accelerated, "
                f"{len(self.skipped)} skipped{'' if self._active else ', restored'}>")

    # ------------------------------------------------------------------ layers
    def _rescan_hook(self, module, args):
        if not self._active:
            return
        model = self._model_ref()
        config = getattr(model, "peft_config", None)
        fingerprint = (tuple(config), len(self._layers)) if isinstance(config, dict) else None
        if fingerprint is None or fingerprint != self._fingerprint:
            from .torch_op import compiling, eager

            # under torch.compile, the scan (which patches modules) runs in Python, outside
            # the graph; the check above is traced, so a model whose adapters did not change
            # has no graph break here
            (eager if compiling() else _call)(self._rescan, model)

    def _rescan(self, model):
        self._scan(model)
        config = getattr(model, "peft_config", None)
        self._fingerprint = (tuple(config), len(self._layers)) if isinstance(config, dict) \
            else None

    def _scan(self, model):
        for name, module in model.named_modules():
            if id(module) in self._layers or module in self._covered:
                continue
            layer = next((got for kind in self._kinds
                          if (got := kind.layer(name, module)) is not None), None)
            if layer is not None:
                self._layers[id(module)] = layer
                self._status[name] = layer.static_reason()
                self._covered.update(layer.covers())
            elif isinstance(module, self._lora_layer_type):
                self._status[name] = (f"{type(module).__name__} is not a plain PEFT LoRA Linear or "
                                      f"Embedding layer")
            elif isinstance(module, self._tuner_layer_type) and name not in self._status:
                self._status[name] = f"{type(module).__name__} is not a LoRA layer"


def _call(fn, *args):
    return fn(*args)


def _layer_kinds(acc):
    """The layer kinds `acc` serves, each in a module of its own (imported at the first
    accelerate_peft): PEFT's LoRA Linear and Embedding layers."""
    from . import experts, lora_kind

    return (lora_kind.Kind(acc), experts.Kind(acc))
