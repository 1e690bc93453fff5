"""Expert LoRA for vLLM's CPU backend (lora.vllm's MoE part).

vLLM 0.32 picks its Triton MoE backend for every LoRA-enabled MoE model, and Triton does not
run on a CPU, so an unquantized MoE model with ``enable_lora=True`` cannot start there.  The
plug-in routes that choice (`install`, from ``register()``) to `LoraCPUExperts`: a CPU experts
class with vLLM's LoRA hooks (``LoRAExpertsMixin``), whose forward runs the routed experts'
base matmuls in torch, grouped per expert, and gets the LoRA terms from lora.vllm's
``add_lora_w13`` / ``add_lora_w2``: one `LoraBank.add_experts_to` call per slice over
`LoraExperts` views of vLLM's stacked expert slots (no copy), only for the (token, expert)
pairs the router chose.  Nothing here edits or copies vLLM's files; vLLM's names are replaced
from ``register()`` for the supported range only.
"""

import torch
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as _method
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin
from vllm.model_executor.layers.fused_moe.oracle import unquantized as _oracle

_ORIGINAL = _oracle.select_unquantized_moe_backend
# gated activations whose halves are [gate | up] (vLLM's w13 layout), as the w13 LoRA slices
_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.GELU, MoEActivation.GELU_TANH)


class LoraCPUExperts(LoRAExpertsMixin, CPUUnquantizedExperts):
    """vLLM's unquantized CPU experts with expert LoRA.

    Weights stay in vLLM's checkpoint layout (``w13 [E, 2I, H]``, ``w2 [E, H, I]``; not the
    grouped-GEMM prepack of vLLM's CPU kernel, which has no hook between the gate/up
    projection and the activation).  Per forward: ``h = x W13_e^T`` (+ bias) for every routed
    pair, the w13 LoRA added per pair, the activation, ``o = act W2_e^T`` (+ bias) weighted by
    the router, the w2 LoRA (weighted alike) added, and the sum over the token's experts.
    """

    @staticmethod
    def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        # the checks of every experts class, without the grouped-GEMM alignment rule of vLLM's
        # CPU kernel (this class does not use it)
        return mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key,
                                                      activation_key, activation_format)

    @staticmethod
    def _supports_activation(activation):
        return activation in _ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config):
        return not moe_parallel_config.use_ep

    def process_weights_after_loading(self, layer):
        self._use_zentorch = False   # keep the weights as loaded (see the class docstring)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        M, K = hidden_states.shape
        top_k = topk_ids.shape[1]
        N = w1.shape[1]
        local = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()]
        cache1 = hidden_states.new_zeros(M, top_k, N)
        _grouped(cache1.view(M * top_k, N), hidden_states, local, w1, self.w1_bias, top_k)
        ctx = self._lora_context
        routing = (None, None, None, None)
        if ctx is not None:   # returns the routing add_lora_w2 reuses
            routing = self.apply_w13_lora(ctx, y=cache1, x=hidden_states, topk_ids=topk_ids,
                                topk_weights=topk_weights, expert_map=expert_map, w1=w1, w2=w2,
                                num_tokens=M, top_k_num=top_k)
        cache2 = hidden_states.new_empty(M * top_k, self.adjust_N_for_activation(N, activation))
        self.activation(activation, cache2, cache1.view(-1, N))
        cache3 = hidden_states.new_zeros(M, top_k, K)
        _grouped(cache3.view(M * top_k, K), cache2, local, w2, self.w2_bias, 1)
        # the router weights (unless vLLM applied them to the input already: top-1 models)
        weights = (torch.ones_like(topk_weights) if apply_router_weight_on_input
                   else topk_weights)
        if not apply_router_weight_on_input:
            cache3.mul_(topk_weights.unsqueeze(-1).to(cache3.dtype))
        if ctx is not None:
            self.apply_w2_lora(ctx, y=cache3, x=cache2, topk_weights=weights,
                               sorted_token_ids_lora=routing[0], expert_ids_lora=routing[1],
                               num_tokens_post_padded_lora=routing[2],
                               token_lora_mapping=routing[3],
                               num_tokens=M, w1=w1, w2=w2, top_k_num=top_k)
        torch.sum(cache3, dim=1, out=output)


def _grouped(out, x, experts, w, bias, rows_per_x):
    """``out[p] = x[p // rows_per_x] W_e^T (+ b_e)`` for every pair ``p`` whose expert ``e``
    (``experts.view(-1)[p]``) is local (>= 0), grouped per expert; other rows stay zero."""
    flat = experts.reshape(-1)
    for e in torch.unique(flat).tolist():
        if e < 0:
            continue
        pairs = (flat == e).nonzero().squeeze(1)
        rows = x.index_select(0, pairs // rows_per_x if rows_per_x > 1 else pairs)
        h = rows @ w[e].T
        if bias is not None:
            h += bias[e]
        out.index_copy_(0, pairs, h.to(out.dtype))


def _select(moe_config):
    """vLLM's unquantized MoE backend choice, with LoRA on the CPU going to `LoraCPUExperts`
    (vLLM's own choice, Triton, cannot run there)."""
    from vllm.platforms import current_platform

    if moe_config.is_lora_enabled and current_platform.is_cpu():
        ok, why = LoraCPUExperts.is_supported_config(
            LoraCPUExperts, moe_config, None, None, mk.FusedMoEActivationFormat.Standard)
        if not ok:
            raise NotImplementedError(
                f"lora-kernels: expert LoRA on vLLM's CPU backend does not support this MoE "
                f"layer ({why}); vLLM's own MoE LoRA backend needs Triton, which does not run "
                f"on a CPU. Serve the model without enable_lora, or without LoRA on it.")
        return _oracle.UnquantizedMoeBackend.CPU, LoraCPUExperts
    return _ORIGINAL(moe_config)


def install():
    """Route vLLM's unquantized MoE backend choice through `_select` (both places that hold
    the function: the oracle module and the MoE method, which imported it by name)."""
    _oracle.select_unquantized_moe_backend = _select
    _method.select_unquantized_moe_backend = _select
