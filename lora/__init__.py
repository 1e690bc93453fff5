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
from .accelerate import accelerate_peft
from .adapter_set import AdapterSet
from .bank import LoraBank
from .delta import LoraDelta
from .dora import DoraDelta
from .errors import LoraFormatError, LoraShapeError
from .experts import LoraExperts
from .adapter import LoraAdapter
from .gguf import load_gguf
from .peft import load_peft
from .scale import LoraScale
from .stack import LoraStack

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
