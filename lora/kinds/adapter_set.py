"""`AdapterSet`: many adapters over one base model, by name, with stable slot ids, hot swap,
and one live bank per projection.

A set is a sequence of slots, each free or holding one named adapter (a mapping from base
names, the GGUF tensor or PEFT module names, to deltas).  Every change builds a new immutable
snapshot under a lock; a bank call reads the snapshot once, so all positions of one call see the
same adapters, and the snapshot keeps every delta it uses alive until the call returns, however
the set changes meanwhile.
"""

import difflib
import threading
import warnings
from collections.abc import Mapping

import numpy as np

from .. import _arrays as arrays
from .. import _status
from .._byvalue import ByValue
from .bank import need_ids
from .._entries import EntryTable, entry_types, owners
from ..errors import LoraShapeError

__all__ = ["AdapterSet"]

BASE = "__base__"  # the name PEFT uses for "no adapter" in a mixed batch


class _Snapshot:
    """One instant of a set: the slots (None = free) and, built on first use, one EntryTable per
    target.  Never changed after publication except for that cache."""

    __slots__ = ("slots", "index", "shapes", "expert_shapes", "free", "has_free", "_tables")

    def __init__(self, slots):
        self.slots = tuple(slots)
        self.index = {s[0]: i for i, s in enumerate(self.slots) if s is not None}
        self.shapes, self.expert_shapes = {}, {}
        for s in self.slots:
            if s is not None:
                for target, entry in s[1].items():
                    self.shapes.setdefault(target, entry.base_shape)
                    self.expert_shapes.setdefault(target, getattr(entry, "expert_shape", None))
        free = [i for i, s in enumerate(self.slots) if s is None]
        self.free = np.zeros(len(self.slots), bool)
        self.free[free] = True
        self.has_free = bool(free)
        self._tables = {}

    def table(self, target):
        table = self._tables.get(target)
        if table is None:
            entries = [None if s is None else s[1].get(target) for s in self.slots]
            # concurrent builders of one target build equal tables; either may win
            table = self._tables.setdefault(target, EntryTable(entries, "slot", routed=True))
        return table


def _check_adapter(name, adapter):
    if not isinstance(name, str):
        raise TypeError(f"an adapter name must be a str; got {type(name).__name__}")
    if name == BASE:
        raise ValueError(f"{BASE!r} means 'no adapter' and cannot name one")
    if not isinstance(adapter, Mapping):
        raise TypeError(f"adapter {name!r} must be a LoraAdapter (a mapping from base names to "
                        f"deltas); got {type(adapter).__name__}")
    for target, entry in adapter.items():
        if not isinstance(entry, entry_types()):
            raise TypeError(f"adapter {name!r}: {target!r} maps to a "
                            f"{type(entry).__name__}, not a LoraDelta or LoraExperts")


def _declared(targets):
    """`AdapterSet(targets=...)`: None, or the frozenset of base names (str) the model has."""
    if targets is None:
        return None
    if isinstance(targets, (str, bytes)) or not hasattr(targets, "__iter__"):
        raise TypeError(f"targets must be an iterable of base names (str), such as a list or the "
                        f"keys of a mapping; got {type(targets).__name__}")
    names = frozenset(targets)
    bad = next((t for t in names if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"targets must be base names (str); got {type(bad).__name__} {bad!r}")
    return names


def _close(name, names):
    """A hint naming up to three of `names` close to `name` (a misspelling), or ""."""
    near = difflib.get_close_matches(name, list(names), n=3, cutoff=0.8)
    return f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""


def _restore(slots, targets=None):
    """Unpickling (and deep copies): a set with these slots (None = free) and declared targets,
    each adapter checked as `AdapterSet.add` checks it."""
    new = AdapterSet(targets=targets)
    made = []
    for s in slots:
        if s is not None:
            name, adapter = s
            _check_adapter(name, adapter)
            new._known(name, adapter)
            snap = _Snapshot(made)
            if name in snap.index:
                raise ValueError(f"adapter name {name!r} is in two slots")
            new._agree(snap, name, adapter)
            s = (name, adapter)
        made.append(s)
    new._snap = _Snapshot(made)
    return new


class AdapterSet(ByValue):
    """Named adapters over one base model, each in a stable slot, for mixed batches.

    ``AdapterSet(adapters=None, *, targets=None)``: an optional ``{name: LoraAdapter}``, added in
    order; ``targets``, optionally, the base names of the model (an iterable of str, e.g. the
    keys of ``{name: (rows, cols)}``), which every adapter's targets and every ``bank()`` name
    must then be among (``KeyError`` naming the close matches otherwise).

    - ``add(name, adapter) -> slot``: a new name (``ValueError`` for a name in use) takes the
      lowest free slot, so a slot id held from before a ``remove`` may name a newer adapter.
    - ``replace(name, adapter) -> slot``: hot swap, the same slot with the new adapter's deltas.
    - ``remove(name)``: the slot becomes free (``KeyError`` when absent, as for ``replace``).
    - ``slot(name)``, ``slots(names)`` (a NumPy int64 array; ``None`` and ``"__base__"`` give
      ``-1``, no adapter; an unknown name is a ``KeyError`` naming it).
    - ``len``, ``in``, iteration (names), ``s[name]`` (the adapter), ``.names`` (slot order),
      ``.targets`` (base names any adapter targets), ``.resident_bytes``.
    - ``bank(target)``: a live bank for one base name (a str; ``TypeError`` otherwise), with
      ``add_batch_to(x, out, adapter_ids, scales=None)``, ``add_rows_to(ids, out, adapter_ids,
      scales=None)``, ``add_experts_to(x, out, adapter_ids, expert_ids, scales=None)`` (a MoE
      target, whose adapters map it to `LoraExperts`), ``base_shape`` and ``expert_shape`` (see
      ``LoraBank``); adapter ids are slot ids.  A slot whose adapter does not target that base
      adds nothing there; a free slot used as an id is an ``IndexError``.  A name no adapter
      targets adds nothing until one does: with declared ``targets`` it must be one of them
      (``KeyError``), without, a ``UserWarning`` (once per name and set) says so, when the
      bank is made or first called while the set holds adapters.

    Every adapter that targets one base name must agree on its ``(rows, cols)`` (and, for
    experts, on ``expert_shape``): ``add`` and ``replace`` refuse one that does not with a
    ``LoraShapeError`` naming the adapter, the target and both shapes, and leave the set
    unchanged.  Changes are serialised and may run
    while other threads are inside bank calls: each call uses the set as it was at one instant,
    and an adapter's memory stays valid until every call that uses it has returned.

    Pickling and ``copy.deepcopy`` keep the slots (free ones included, so slot ids keep their
    meaning) and every adapter by value; ``copy.copy`` is a new set of the same adapters in the
    same slots, changed independently of this one from then on.
    """

    def _parts(self):
        """By value (lora._byvalue): the slots, ``(name, adapter)`` or None, and the declared
        targets."""
        return _restore, (list(self._snap.slots), self._targets)

    def __init__(self, adapters=None, *, targets=None):
        self._lock = threading.Lock()
        self._snap = _Snapshot(())
        self._targets = _declared(targets)
        self._warned = set()  # bank names already warned about (no adapter targets them)
        if adapters is not None:
            if not isinstance(adapters, Mapping):
                raise TypeError(f"adapters must be a mapping {{name: LoraAdapter}}; got "
                                f"{type(adapters).__name__}")
            for name, adapter in adapters.items():
                self.add(name, adapter)

    # ------------------------------------------------------------------ changes
    def _agree(self, snap, name, adapter, skip_slot=None):
        for target, entry in adapter.items():
            want = _shape_of(entry)
            for i, s in enumerate(snap.slots):
                if s is None or i == skip_slot or target not in s[1]:
                    continue
                have = _shape_of(s[1][target])
                if want is not None and have is not None and have != want:
                    raise LoraShapeError(
                        f"adapter {name!r} has {target!r} as {_shown(want)} but adapter "
                        f"{s[0]!r} in this set has it as {_shown(have)}; every adapter on one "
                        f"base must agree", rows=want[-2], cols=want[-1])

    def _known(self, name, adapter):
        """With declared targets, every target of `adapter` must be one of them."""
        if self._targets is None:
            return
        for target in adapter:
            if target not in self._targets:
                raise KeyError(f"adapter {name!r} targets {target!r}, which is not one of the "
                               f"set's declared targets{_close(target, self._targets)}")

    def add(self, name, adapter):
        """Add ``adapter`` as ``name`` in the lowest free slot; returns the slot id."""
        _check_adapter(name, adapter)
        self._known(name, adapter)
        with self._lock:
            snap = self._snap
            if name in snap.index:
                raise ValueError(f"adapter name {name!r} is already in the set (slot "
                                 f"{snap.index[name]}); use replace() to swap it")
            self._agree(snap, name, adapter)
            slots = list(snap.slots)
            slot = next((i for i, s in enumerate(slots) if s is None), len(slots))
            if slot == len(slots):
                slots.append(None)
            slots[slot] = (name, adapter)
            self._snap = _Snapshot(slots)
            return slot

    def replace(self, name, adapter):
        """Swap the adapter named ``name`` for ``adapter`` in the same slot; returns the slot."""
        _check_adapter(name, adapter)
        self._known(name, adapter)
        with self._lock:
            snap = self._snap
            slot = self._slot_of(snap, name)
            self._agree(snap, name, adapter, skip_slot=slot)
            slots = list(snap.slots)
            slots[slot] = (name, adapter)
            self._snap = _Snapshot(slots)
            return slot

    def remove(self, name):
        """Remove the adapter named ``name``; its slot becomes free."""
        with self._lock:
            snap = self._snap
            slot = self._slot_of(snap, name)
            slots = list(snap.slots)
            slots[slot] = None
            while slots and slots[-1] is None:  # trailing free slots are simply gone
                slots.pop()
            self._snap = _Snapshot(slots)

    # ------------------------------------------------------------------ lookups
    @staticmethod
    def _slot_of(snap, name):
        try:
            return snap.index[name]
        except (KeyError, TypeError):
            raise KeyError(f"no adapter named {name!r} in the set; names: "
                           f"{sorted(snap.index)}") from None

    def slot(self, name):
        """The slot id of ``name`` (``KeyError`` naming it when absent)."""
        return self._slot_of(self._snap, name)

    def slots(self, names):
        """Slot ids for a sequence of names, as a NumPy int64 array: ``None`` and ``"__base__"``
        give -1 (no adapter); an unknown name is a ``KeyError`` naming it."""
        snap = self._snap
        if isinstance(names, str):
            raise TypeError("slots() takes a sequence of names; for one name use slot()")
        out = np.empty(len(names), np.int64)
        for i, name in enumerate(names):
            out[i] = -1 if name is None or name == BASE else self._slot_of(snap, name)
        return out

    def __len__(self):
        return len(self._snap.index)

    def __contains__(self, name):
        return name in self._snap.index

    def __iter__(self):
        return iter(self.names)

    def __getitem__(self, name):
        snap = self._snap
        return snap.slots[self._slot_of(snap, name)][1]

    @property
    def names(self):
        """The adapter names in slot order."""
        return [s[0] for s in self._snap.slots if s is not None]

    @property
    def targets(self):
        """The set of base names at least one adapter targets."""
        return set(self._snap.shapes)

    @property
    def declared_targets(self):
        """The base names given as ``targets=`` (a frozenset), or None."""
        return self._targets

    @property
    def resident_bytes(self):
        """The sum of the adapters' resident bytes (a delta shared by two adapters counts once)."""
        seen = {}
        for s in self._snap.slots:
            if s is not None:
                for entry in s[1].values():
                    for d in owners(entry):
                        seen[id(d)] = d
        return sum(d.resident_bytes for d in seen.values())

    def __repr__(self):
        return f"AdapterSet({self.names}, {len(self.targets)} targets)"

    def bank(self, target):
        """A live bank for base name ``target`` (a str): it sees later changes to the set at its
        next call, and adds nothing while no adapter targets ``target``.  ``KeyError`` for a
        name outside the declared targets (naming the close ones); without declared targets, a
        name no adapter of a non-empty set targets gives a ``UserWarning`` (once per name)."""
        if not isinstance(target, str):
            raise TypeError(f"a bank's target is a base name (a str, such as "
                            f"'model.layers.0.self_attn.q_proj' or 'blk.0.attn_q.weight'); got "
                            f"{type(target).__name__} {target!r}")
        if self._targets is not None and target not in self._targets:
            raise KeyError(f"{target!r} is not one of the set's declared targets"
                           f"{_close(target, self._targets)}")
        self._untargeted(self._snap, target, stacklevel=3)  # the caller's bank() line
        return _SetBank(self, target)

    def _untargeted(self, snap, target, stacklevel):
        """Warn, once per name, that no adapter of a set holding adapters targets `target` (a
        misspelt name adds nothing, forever); declared targets have checked the name already."""
        if (target in snap.shapes or not snap.index or self._targets is not None
                or target in self._warned):
            return
        self._warned.add(target)
        warnings.warn(f"AdapterSet.bank({target!r}): no adapter in the set targets {target!r}, so "
                      f"its bank adds nothing until one does{_close(target, snap.shapes)} (declare "
                      f"the model's base names, AdapterSet(targets=...), to have every name "
                      f"checked)", UserWarning, stacklevel=stacklevel)


class _SetBank:
    """`AdapterSet.bank(target)`: the bank methods over the set's current snapshot."""

    __slots__ = ("_set", "_target")

    def __init__(self, adapter_set, target):
        self._set, self._target = adapter_set, target

    def __repr__(self):
        return f"<AdapterSet bank for {self._target!r}, base_shape={self.base_shape}>"

    @property
    def target(self):
        """The base name this bank serves."""
        return self._target

    @property
    def base_shape(self):
        """(rows, cols) of the base, or None while no adapter targets it."""
        return self._set._snap.shapes.get(self._target)

    def _table(self, adapter_ids):
        """The target's table in one instant of the set (for the whole call), after the ids'
        checks that only the set can make."""
        need_ids(adapter_ids)
        snap = self._set._snap
        if snap.has_free:
            _no_free_slot(snap, adapter_ids)
        table = snap._tables.get(self._target)
        if table is None:  # the first call on this instant of the set
            self._set._untargeted(snap, self._target, stacklevel=4)  # the caller's call
            table = snap.table(self._target)
        return table

    def add_batch_to(self, x, out, adapter_ids, scales=None):
        """As ``LoraBank.add_batch_to``, with the set's slot ids as adapter ids."""
        return self._table(adapter_ids).apply_batch(x, out, adapter_ids, scales)

    def add_rows_to(self, ids, out, adapter_ids, scales=None):
        """As ``LoraBank.add_rows_to``, with the set's slot ids as adapter ids."""
        return self._table(adapter_ids).apply_rows(ids, out, adapter_ids, scales)

    @property
    def expert_shape(self):
        """(n_experts, rows, cols) of a MoE target's experts; None for a plain target, or while
        no adapter targets it."""
        return self._set._snap.expert_shapes.get(self._target)

    def add_experts_to(self, x, out, adapter_ids, expert_ids, scales=None):
        """As ``LoraBank.add_experts_to``, with the set's slot ids as adapter ids."""
        table = self._table(adapter_ids)
        if table.base_shape is not None and table.expert_shape is None:
            raise TypeError(f"add_experts_to needs a MoE target; {self._target!r} holds plain "
                            f"deltas (use add_batch_to)")
        return table.apply_experts(x, out, expert_ids, adapter_ids, scales)


def _shape_of(entry):
    """What adapters on one target must agree on: (rows, cols), or (n_experts, rows, cols) for
    experts; None for an entry without a shape (an empty stack)."""
    if entry.base_shape is None:
        return None
    return getattr(entry, "expert_shape", None) or entry.base_shape


def _shown(shape):
    plain = f"[{shape[-2]} x {shape[-1]}]"
    return plain if len(shape) == 2 else f"{shape[0]} experts of {plain}"


def _no_free_slot(snap, adapter_ids):
    """A free slot used as an id is an IndexError naming it (checked only while a set has
    holes: the common case costs nothing)."""
    ids = arrays.as_ids(adapter_ids, "adapter_ids", any_shape=True, bound=snap.free.size)
    flat = ids.reshape(-1)
    inside = (flat >= 0) & (flat < snap.free.size)
    hit = np.flatnonzero(inside & snap.free[np.where(inside, flat, 0)])
    if hit.size:
        pos = int(hit[0])
        raise IndexError(f"adapter id {int(flat[pos])} at position {_status.position_of(ids, pos)} "
                         f"names a free slot of the set (its adapter was removed)")
