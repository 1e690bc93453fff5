"""The LoRA term of a served PEFT layer as a torch custom op, so that ``torch.compile`` of an
accelerated model calls the kernels from inside its graphs.

Under ``torch.compile`` (TorchDynamo tracing) a served LoRA ``Linear`` / ``Embedding`` layer
traces as PEFT's computation would, in two steps: the base layer (torch ops, traced and compiled
like any other), then one call of ``lora_kernels::peft_lora_term(x, out, layer, adapter_names)``,
which adds the layer's LoRA term into ``out`` (the base layer's output) in place.  The op is
opaque to the compiler: its fake (meta) implementation does nothing (``out`` keeps its shape,
dtype and strides), and its CPU implementation is ``term_into`` of the served layer that the
int ``layer`` names (the ``id()`` of its PEFT module, in a model accelerated now), which reads
the active adapters, ``scaling``, merge state and the weights at every call and runs the
kernels, exactly as the eager forward does after its base call; so a compiled graph stays right
when adapters are switched, scaled, loaded or changed (nothing about them is baked into it).
``adapter_names`` is PEFT's mixed-batch list (None: the active adapters).

The op mutates ``out`` (schema ``Tensor(a!) out``): the compiler's functionalization keeps that
correct wherever the base layer's output is also used elsewhere (copying it first), and writes
in place where it is not.

This module imports torch: it is imported by the PEFT acceleration modules only (``import
lora`` never imports it).
"""

import weakref

import torch

__all__ = ["term", "compiling", "eager"]

_NAMESPACE = "lora_kernels"
_OP = "peft_lora_term"


_SEEN = weakref.WeakValueDictionary()  # layer handle -> its served layer, once an op ran it


def _served(layer):
    """The served layer of the module whose id() is `layer`: found in a model accelerated now
    (then remembered while that served layer lives), else None."""
    served = _SEEN.get(layer)
    if served is None or not served.acc._active:  # (restored: the module may be served anew)
        from .served import ACCELERATED as _ACCELERATED

        for acc in list(_ACCELERATED.values()):
            found = acc._layers.get(layer)
            if found is not None:
                _SEEN[layer] = served = found
                break
    return served


def _term_cpu(x, out, layer, adapter_names):
    served = _served(layer)
    if served is None:  # restore() ran and the layer is gone: torch recompiles a graph traced
        raise RuntimeError(  # before (its guards see the module's forward change); not this one
            f"{_NAMESPACE}::{_OP}: the layer this graph was traced with is no longer "
            f"accelerated (restore() was called); compile the model again")
    served.term_into(x, out, adapter_names)


def _term_fake(x, out, layer, adapter_names):
    return None


def _define():
    """Define the op once per process (a reload of this module finds it defined)."""
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    if not hasattr(getattr(torch.ops, _NAMESPACE), _OP):
        lib.define(f"{_OP}(Tensor x, Tensor(a!) out, int layer, str[]? adapter_names) -> ()")
        lib.impl(_OP, _term_cpu, "CPU")
        register_fake = getattr(torch.library, "register_fake", None)  # torch >= 2.4
        if register_fake is not None:
            register_fake(f"{_NAMESPACE}::{_OP}", _term_fake, lib=lib)
        else:  # older torch: a Meta kernel is what tracing runs
            lib.impl(_OP, _term_fake, "Meta")
    return lib


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


_LIB = _define()
term = getattr(getattr(torch.ops, _NAMESPACE), _OP).default
# True while TorchDynamo traces the caller (torch.compile, torch.export), else False at the cost
# of a plain Python call (~20 ns; is_compiling checks TorchScript first, ~100 ns)
compiling = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling
# eager(fn, *args, **kwargs): fn runs in Python, outside the graph (one clean graph break)
eager = torch.compiler.disable(_call)
