"""`LoraScale`: the runtime scale one adapter's deltas share."""

import math

__all__ = ["LoraScale"]

# Doubles at or above this magnitude round to inf in float32 (round to nearest even: halfway
# between float32's largest value, (2 - 2**-23) * 2**127, and 2**128); everything below is finite.
# The one threshold for every Python-side "finite in float32" check (scales, alphas, PEFT scaling).
F32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103

# Bumped by every set(): a stack or bank compares it with the value it saw at its last call, and
# reads its scales again only when some LoraScale changed (a call then costs no per-scale work).
epoch = [0]


class LoraScale:
    """A mutable float shared by every delta of one adapter (llama.cpp's per-adapter user scale).

    Deltas read it once per call, so ``scale.set(0.5)`` rescales every projection at once and
    recomputes nothing.  ``value`` must be finite in float32, the precision the kernels compute
    in (``ValueError`` otherwise, also for ``1e39``: finite as a Python float, inf in float32);
    negative scales and 0 are allowed (0 skips the delta before any arithmetic).
    """

    __slots__ = ("_value",)  # the apply paths read _value directly (the property is a call)

    def __init__(self, value=1.0):
        self._value = 0.0
        self.set(value)

    def get(self):
        """The current scale (a Python float)."""
        return self._value

    def set(self, value):
        """Set the scale; raises ``TypeError`` for a non-real value, ``ValueError`` for one that is
        not finite in float32 (nothing changes then)."""
        if (isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")
                or not isinstance(value, (int, float)) and not hasattr(value, "__float__")):
            # a bool (Python's, NumPy's np.bool_ or a 0-d bool array or tensor) is not a scale
            raise TypeError(f"LoraScale value must be a real number, got {type(value).__name__}")
        try:
            v = float(value)
        except OverflowError:  # e.g. the int 10**400: not finite as a float
            raise ValueError(f"LoraScale value must be finite, got {value!r}") from None
        except (TypeError, ValueError):
            raise TypeError(f"LoraScale value must be a real number, got {value!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"LoraScale value must be finite, got {v}")
        if abs(v) >= F32_OVERFLOW:     # the kernels compute in float32, where it would be inf
            raise ValueError(f"LoraScale value must be finite in float32 (|value| <= "
                             f"3.4028235e+38), got {v!r}")
        self._value = v
        epoch[0] += 1

    value = property(get, set, doc="The current scale (float); setting it validates as `set`.")

    def __reduce__(self):  # pickles and copies: a new LoraScale of the same value
        return LoraScale, (self._value,)

    def __float__(self):
        return self._value

    def __repr__(self):
        return f"LoraScale({self._value!r})"
