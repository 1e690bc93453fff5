"""`LoraScale`: the runtime scale one adapter's deltas share."""

import math

__all__ = ["LoraScale"]


class LoraScale:
    """A mutable float shared by every delta of one adapter (llama.cpp's per-adapter user scale).

    Deltas read it once per call, so ``scale.set(0.5)`` rescales every projection at once and
    recomputes nothing.  ``value`` must be finite (``ValueError`` otherwise); negative scales and 0
    are allowed (0 skips the delta before any arithmetic).
    """

    __slots__ = ("_value",)

    def __init__(self, value=1.0):
        self._value = 0.0
        self.set(value)

    def get(self):
        """The current scale (a Python float)."""
        return self._value

    def set(self, value):
        """Set the scale; raises ``TypeError`` for a non-real value, ``ValueError`` if not finite."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise TypeError(f"LoraScale value must be a real number, got {type(value).__name__}")
        try:
            v = float(value)
        except OverflowError:  # e.g. the int 10**400: not finite as a float
            raise ValueError(f"LoraScale value must be finite, got {value!r}") from None
        except (TypeError, ValueError):
            raise TypeError(f"LoraScale value must be a real number, got {value!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"LoraScale value must be finite, got {v}")
        self._value = v

    value = property(get, set, doc="The current scale (float); setting it validates as `set`.")

    def __float__(self):
        return self._value

    def __repr__(self):
        return f"LoraScale({self._value!r})"
