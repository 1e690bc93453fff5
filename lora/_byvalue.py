"""Pickling and copies by value: one design for every adapter kind.

A kind says what it *is* in `ByValue._parts`: ``(rebuild, args)``, where ``rebuild(*args)``
makes an equal, independent object.  ``args`` hold values only: the stored factors as NumPy
arrays of their bit patterns (made afresh by ``_parts``), plain numbers and strings, the
`LoraScale` (itself pickled by value), and the objects it is made of (a stack's deltas, an
adapter's deltas, a set's adapters), which are by-value kinds in turn.  Never a pointer, a view
of a caller's memory or a cache: those are rebuilt.  A kind whose values are not a LoRA pair
gives its own (a DoRA delta: its factors and the statistics and magnitude it keeps, not the
caller's base).  From that one method:

- ``pickle``: ``__reduce__`` is ``_parts()``.  An object reached twice within one pickle (a
  `LoraScale` shared by deltas, a delta in two stacks) is stored once and shared again after
  loading, as pickle does for any object.
- ``copy.deepcopy``: ``rebuild`` over deep copies of ``args`` with the one memo: new storage and
  new `LoraScale` objects, shared among the copies as they were among the originals.
- ``copy.copy``: ``_shallow()``; by default ``rebuild(*args)`` with the members themselves (a new
  container of the same deltas, the same `LoraScale`); a kind that owns storage shares it
  (factors are never written after construction) and overrides ``_shallow``.

`rebuild` functions check what they are given as the constructors do, so a corrupt pickle is an
exception, never a kernel reading past a buffer.
"""

import copy

import numpy as np

__all__ = ["ByValue", "same_slots"]


class ByValue:
    """Mixin: ``__reduce__``, ``__copy__`` and ``__deepcopy__`` from ``_parts()`` (see the module
    docstring)."""

    __slots__ = ()

    def _parts(self):  # pragma: no cover - every kind defines it
        raise NotImplementedError

    def _shallow(self):
        rebuild, args = self._parts()
        return rebuild(*args)

    def __reduce__(self):
        return self._parts()

    def __copy__(self):
        return self._shallow()

    def __deepcopy__(self, memo):
        rebuild, args = self._parts()
        # the arrays of _parts are fresh already: copying them again would only cost memory
        return rebuild(*(a if type(a) is np.ndarray else copy.deepcopy(a, memo) for a in args))


def same_slots(obj):
    """A new object of ``obj``'s type with every slot bound to the same value (a `_shallow` for a
    kind whose slots are all immutable or shareable)."""
    cls = type(obj)
    new = cls.__new__(cls)
    for name in cls.__slots__:
        if name != "__weakref__":
            setattr(new, name, getattr(obj, name))
    return new
