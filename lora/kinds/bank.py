"""`LoraBank`: a different adapter for every position of one batch (BGMV/SGMV on the CPU)."""

from .._byvalue import ByValue
from .._entries import EntryTable

__all__ = ["LoraBank"]


class LoraBank(ByValue):
    """Adapter slots for mixed batches: position ``b`` gets ``entries[adapter_ids[b]]``.

    ``LoraBank(entries)``: each entry a ``LoraDelta``, a ``LoraStack`` or ``None`` (no adapter),
    all of one ``rows x cols`` (else ``LoraShapeError`` naming the entry and both shapes); ranks and
    storage dtypes may differ.  ``len``, ``bank[i]``, ``.resident_bytes``.  Or a bank of
    `LoraExperts` (and ``None``) of one ``expert_shape``, for `add_experts_to`.

    One C call per batch: positions are grouped by adapter (a counting sort, punica's SGMV idea)
    so each adapter's weights stream once per block of positions, threads take blocks, and every
    position's bits equal applying its entry alone with ``add_to`` / ``add_row_to``: results never
    depend on the batch's composition or order.  ``-1`` means no adapter (it never wraps to the
    last slot); any other id outside ``[0, len)`` is an ``IndexError`` naming the id and its
    position, raised before anything is written.

    Pickling and ``copy.deepcopy`` keep the entries by value (one delta or `LoraScale` in
    several places stays one); ``copy.copy`` is a new bank of the same entries.
    """

    __slots__ = ("_table",)

    def _parts(self):
        """By value (lora._byvalue): the entries, in slot order."""
        return LoraBank, (list(self._table.entries),)

    def __init__(self, entries):
        self._table = EntryTable(entries, "bank entry", routed=True)

    def __len__(self):
        return self._table.n_entries

    def __getitem__(self, i):
        return self._table.entry(i)

    def __iter__(self):
        return iter(self._table.entries)

    def __repr__(self):
        return f"LoraBank({len(self)} entries, base_shape={self.base_shape})"

    @property
    def base_shape(self):
        """(rows, cols) shared by every entry; None when no entry holds a delta."""
        return self._table.base_shape

    @property
    def expert_shape(self):
        """(n_experts, rows, cols) when the entries are `LoraExperts`, else None."""
        return self._table.expert_shape

    @property
    def resident_bytes(self):
        """Sum of the distinct deltas' resident_bytes over all entries."""
        return self._table.resident_bytes()

    def add_batch_to(self, x, out, adapter_ids, scales=None):
        """``out[b] += entries[adapter_ids[b]]``'s delta of ``x[b]``, times ``scales[b]``;
        returns ``out``.

        ``x``: real float ``[..., cols]``; ``out``: ``[..., rows]`` (float32, float16 or
        bfloat16; NumPy or a CPU torch tensor; C-contiguous or row-strided); ``adapter_ids``:
        integers of the leading shape, or of a prefix of it repeated over the remaining axes
        (ids of shape ``[batch]`` give one adapter per sequence of a ``[batch, seq, hidden]``
        input); ``-1`` = no adapter.  ``scales`` (optional, the shape of ``adapter_ids``, real,
        not bool): position b's delta k uses ``float32(float64(effective_scale_k) *
        float64(scales[b]))``; 0 leaves the position untouched, 1 gives the bits of no scales.
        Errors as ``LoraDelta.add_batch_to``, plus ValueError for ids or scales of the wrong
        shape or a scale that is not finite (also as a product), and IndexError for an id out of
        range; ``out`` is untouched on every error.
        """
        need_ids(adapter_ids)
        return self._table.apply_batch(x, out, adapter_ids, scales)

    def add_rows_to(self, ids, out, adapter_ids, scales=None):
        """``out[i] += entries[adapter_ids[i]]``'s embedding delta of token ``ids[i]``, times
        ``scales[i]``.

        ``ids``: integers in ``[0, rows)`` of any shape; ``out``: ``[*ids.shape, cols]``;
        ``adapter_ids`` / ``scales``: as ``add_batch_to``.  Every id is checked before anything
        is written.
        """
        need_ids(adapter_ids)
        return self._table.apply_rows(ids, out, adapter_ids, scales)

    def add_experts_to(self, x, out, adapter_ids, expert_ids, scales=None):
        """A bank of `LoraExperts`: slot ``j`` of token ``t`` (``out[..., t, j, :]``) gets expert
        ``expert_ids[..., t, j]`` of entry ``adapter_ids[...]``, times ``scales[...]``; returns
        ``out``.

        ``x``, ``out`` and ``expert_ids`` as `LoraExperts.add_to` (either routing form).
        ``adapter_ids`` (and ``scales``, of the same shape): per token, ``expert_ids.shape[:-1]``
        or a prefix of it repeated over the remaining axes (``[batch]`` ids for a ``[batch, seq,
        k]`` routing), or per slot, ``expert_ids.shape`` (the flattened forms); ``-1`` (or a
        None entry) means no adapter, ``-1`` in ``expert_ids`` no expert.  Scales as
        `add_batch_to`'s.  Each row is bit-identical to its entry alone (with its LoraScale set
        to ``value * scales[...]`` when the alpha factor is 1).  Every id and scale is checked
        before anything is written (IndexError naming an expert or adapter id and its position,
        ValueError for shapes and scales); ``TypeError`` when the entries are not experts.
        """
        need_ids(adapter_ids)
        return self._experts_table().apply_experts(x, out, expert_ids, adapter_ids, scales)

    def _experts_table(self):
        table = self._table
        if table.base_shape is not None and table.expert_shape is None:
            raise TypeError("add_experts_to needs a bank of LoraExperts entries; these entries "
                            "are plain deltas (use add_batch_to)")
        return table


def need_ids(adapter_ids):
    """A bank call names every position's adapter: None is a TypeError (``-1`` means "no
    adapter"), never a silent "entry 0 everywhere"."""
    if adapter_ids is None:
        raise TypeError("adapter_ids must be integers, one per position (-1 = no adapter); got "
                        "None")
