"""The served layer: what every layer kind of `accelerate_peft` is over a PEFT module (it patches
the module's ``forward`` and keeps PEFT's own as the fallback), the registry of active
accelerations, and the rules every kind shares: forward hooks that send a call to PEFT, and what
derived data of a tensor is keyed on (`version`)."""

import types
import weakref

__all__ = ["ACCELERATED", "ServedLayer", "hook_reason", "version"]

ACCELERATED = weakref.WeakKeyDictionary()  # model -> its PeftAcceleration while active


class _Forward:
    """A PEFT layer's `forward` while it is accelerated: its served layer while it has one
    (``layer``, None once unpatched: a wrapper someone put around it may still call it), else
    PEFT's forward.  A copy of the model (``copy.deepcopy``, pickling, ``torch.save``) gets
    PEFT's own forward back: the acceleration belongs to the model it was made for."""

    __slots__ = ("module", "layer")

    def __init__(self, module, layer):
        self.module, self.layer = module, layer

    def __call__(self, *args, **kwargs):
        layer = self.layer  # a slot, not a weak-keyed lookup: this runs at every layer call
        if layer is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        return layer.forward(*args, **kwargs)

    def __reduce__(self):
        return (_peft_forward, (self.module,))


def _peft_forward(module):
    return types.MethodType(type(module).forward, module)


def hook_reason(acc, module, parts, names):
    """Why a served layer must leave this call to PEFT's forward because torch would run hooks
    in it that the kernels skip: a global module forward hook, or a forward hook or pre-hook on
    ``module.<part>[name]`` for a ``part`` of ``parts`` (the ModuleDicts whose entries PEFT's
    forward calls, such as ``"lora_A"``) and a ``name`` of ``names`` (the adapters of this call);
    None when none is registered.  A few dict truth tests, so every call can ask: the layer is
    served again once the hooks are removed."""
    g = acc._module_globals
    if g._global_forward_hooks or g._global_forward_pre_hooks:
        return "global module forward hooks are registered (PEFT's forward runs them)"
    mods = module._modules
    for part in parts:
        entries = mods[part]._modules
        for a in names:
            sub = entries.get(a)
            if sub is not None and (sub._forward_hooks or sub._forward_pre_hooks):
                return (f"{part}[{a!r}] has forward hooks (PEFT's forward runs while they are "
                        f"registered)")
    return None


def version(t):
    """What the derived data kept of tensor ``t`` is keyed on besides its data pointer: its
    version counter, which in-place changes through the tensor move; None for an inference
    tensor (made under ``torch.inference_mode()``), which has none.  An inference tensor can be
    changed in place only inside inference mode, and nothing counts such a change: like a raw
    ``.data`` write, it is seen after ``acc.refresh()`` (a new tensor in its place -- a new
    adapter, a merge, ``.data = t`` -- moves the data pointer, and is seen at the next call)."""
    return None if t.is_inference() else t._version


class ServedLayer:
    """What every layer kind's served layer is: created over a PEFT layer module, it patches the
    module's ``forward`` (through `_Forward`) and keeps PEFT's own as ``original``, the fallback;
    ``unpatch()`` puts back exactly what was there.  A kind adds ``forward(x, *args, **kwargs)``,
    ``static_reason()`` (why the layer's configuration cannot be served, or None) and
    ``refresh()`` (forget data derived from the weights); it may override ``covers()`` (inner
    modules it answers for, left out of the status) and ``extra_bytes()`` (memory it holds
    beyond PEFT's tensors)."""

    __slots__ = ("acc", "name", "module", "had_instance_forward", "original", "patch",
                 "__weakref__")

    def __init__(self, acc, name, module):
        self.acc, self.name, self.module = acc, name, module
        self.had_instance_forward = "forward" in module.__dict__
        self.original = module.forward
        self.patch = module.forward = _Forward(module, self)

    def covers(self):
        return ()

    def extra_bytes(self):
        return 0

    def unpatch(self):
        self.patch.layer = None  # a wrapper holding the patch now gets PEFT's forward
        if self.had_instance_forward:
            self.module.forward = self.original
        else:
            self.module.__dict__.pop("forward", None)
