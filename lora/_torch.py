"""torch, as lora sees it without importing it: whether an object is a tensor, where it lives,
its dtype code, and autograd's version counter for the tensors the kernels write in place.

torch is never imported here: a tensor is recognised only when the caller's process already
imported torch (``sys.modules``).  At the first tensor, `torch_init` fills the dtype codes and
hands lora._edge what it reads tensors with (torch.Tensor, the DLPack export, grad mode, the
version bump).
"""

import sys

from . import _dtypes as dtypes
from . import _edge

TORCH_CODES = {}  # dtypes.torch_codes(), filled in place at the first tensor
_GRAD_ENABLED = _BUMP = None  # torch.is_grad_enabled, the version bump: filled with it


def torch_module():
    """torch, if this process imported it (never imported here)."""
    return sys.modules.get("torch")


def is_tensor(obj):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def note_write(t):
    """Tell autograd that tensor `t` is about to be written in place (its version counter), as
    torch's own in-place ops do, so a backward that saved `t` raises instead of silently using
    the new values.  Done when grad mode is on; under torch.no_grad() / inference_mode() the
    write is like a ``.data`` write, which autograd does not track either."""
    if _GRAD_ENABLED():
        _BUMP((t,))


def torch_init():
    """Fill the tensor dtype codes and the autograd hooks at the first tensor seen: the version
    bump is torch's own ``autograd.graph.increment_version`` without its Python wrapper (~0.1 us
    a call) where torch has that entry point."""
    global _GRAD_ENABLED, _BUMP
    torch = torch_module()
    _GRAD_ENABLED = torch.is_grad_enabled
    _BUMP = getattr(torch._C, "_increment_version", None) or torch.autograd.graph.increment_version
    TORCH_CODES.update(dtypes.torch_codes())
    # lora._edge reads a plain tensor's memory, device, dtype, shape and strides from one DLPack
    # export, and notes writes as note_write does
    from torch.utils.dlpack import to_dlpack
    _edge.setup_torch(torch.Tensor, to_dlpack, _GRAD_ENABLED, _BUMP)
    return TORCH_CODES


def version_bump():
    """torch's version bump of `note_write` (a callable taking a tuple of tensors)."""
    if _BUMP is None:
        torch_init()
    return _BUMP


def torch_code(t):
    """The dtype code of tensor `t`'s dtype, or None."""
    return (TORCH_CODES or torch_init()).get(t.dtype)


def check_tensor_place(t, what):
    """A CPU, strided (dense) tensor; TypeError naming the device or layout otherwise."""
    if not t.is_cpu:
        raise TypeError(f"{what} is a torch tensor on device {str(t.device)!r}; lora-kernels "
                        f"computes on the CPU: pass a tensor on device 'cpu'")
    if getattr(t, "is_nested", False):
        raise TypeError(f"{what} is a nested (ragged) torch tensor; a dense (strided) tensor is "
                        f"needed")
    if t.layout != torch_module().strided:
        raise TypeError(f"{what} is a torch tensor with layout {t.layout}; a dense (strided) "
                        f"tensor is needed")
    if t.data_ptr() == 0 and t.numel() > 0:
        raise TypeError(f"{what} is a torch tensor without memory (a zero tensor, as autograd "
                        f"makes for an unused gradient); a tensor with memory is needed, e.g. "
                        f"torch.zeros_like({what})")
