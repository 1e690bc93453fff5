"""Exception types of lora-kernels (which error is raised when: docs/api.md, "Errors")."""

__all__ = ["LoraShapeError", "LoraFormatError"]


class LoraShapeError(ValueError):
    """A LoRA pair that does not fit its base, or a delta that does not fit a stack, bank or base.

    Attributes ``rows``, ``cols``, ``rank``, ``a_len``, ``b_len`` give the base dims, the rank and
    the number of values found in ``lora_a`` / ``lora_b`` (``None`` where they do not apply).
    The message names every dimension, in the wording of the design this library follows::

        LoRA pair does not fit a [3 x 4] base at rank 2: lora_a has 6 values (want rank x cols = 8),
        lora_b has 5 values (want rows x rank = 6)
    """

    def __init__(self, message, *, rows=None, cols=None, rank=None, a_len=None, b_len=None):
        super().__init__(message)
        self.rows, self.cols, self.rank = rows, cols, rank
        self.a_len, self.b_len = a_len, b_len

    @classmethod
    def for_pair(cls, rows, cols, rank, a_len, b_len):
        """The error for a pair of ``a_len`` / ``b_len`` values that does not fit a ``[rows x cols]``
        base at ``rank``, in the fixed wording above."""
        msg = (
            f"LoRA pair does not fit a [{rows} x {cols}] base at rank {rank}: "
            f"lora_a has {a_len} values (want rank x cols = {rank * cols}), "
            f"lora_b has {b_len} values (want rows x rank = {rows * rank})"
        )
        return cls(msg, rows=rows, cols=cols, rank=rank, a_len=a_len, b_len=b_len)


class LoraFormatError(ValueError):
    """An adapter file that cannot be loaded (the message starts with the file's path and names
    the tensor or config key), or a target name outside `LoraAdapter.renamed`'s map.  A
    ``ValueError``."""
