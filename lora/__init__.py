"""lora-kernels: add LoRA deltas ``s * B (A x)`` in place on the CPU, with SIMD + OpenMP C kernels.

    import numpy as np, lora
    d = lora.LoraDelta(lora_a, lora_b, alpha=16)   # A [rank, cols], B [rows, rank]
    y = W @ x                                        # your base projection
    d.add_to(x, y)                                   # y += (alpha / rank) * B (A x)

Every public name's docstring gives its shapes, dtypes, errors and the upstream rule it follows;
the repository's docs/ folder holds the whole contract (api.md, input-contract.md, guarantees.md,
file-formats.md, serving.md, peft.md).  `python -m lora info` prints the kernel path this
machine uses.
"""

from ._runtime import __version__, get_num_threads, kernel_info, set_num_threads
from .errors import LoraFormatError, LoraShapeError
from .kinds.adapter_set import AdapterSet
from .kinds.bank import LoraBank
from .kinds.delta import LoraDelta
from .kinds.dora import DoraDelta
from .kinds.experts import LoraExperts
from .kinds.stack import LoraStack
from .loaders.adapter import LoraAdapter
from .loaders.gguf import load_gguf
from .loaders.peft import load_peft
from .peft_accel.accelerate import accelerate_peft
from .scale import LoraScale

__all__ = [
    "LoraScale",
    "LoraShapeError",
    "LoraFormatError",
    "LoraDelta",
    "DoraDelta",
    "LoraStack",
    "LoraExperts",
    "LoraBank",
    "AdapterSet",
    "accelerate_peft",
    "LoraAdapter",
    "load_peft",
    "load_gguf",
    "set_num_threads",
    "get_num_threads",
    "kernel_info",
    "__version__",
]
