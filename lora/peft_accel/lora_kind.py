"""PEFT's plain LoRA ``Linear`` and ``Embedding`` layers (aLoRA and DoRA included) as a layer
kind of `accelerate_peft`: PEFT's types, which modules it serves, and why a layer's
configuration cannot be served."""

from .lora_layer import Layer

__all__ = ["Kind"]


class Kind:
    """PEFT's plain LoRA ``Linear`` and ``Embedding`` layers (aLoRA included), for one
    `PeftAcceleration`: the PEFT types, which modules it serves, and why one cannot be served."""

    def __init__(self, acc):
        from peft.tuners.lora import layer as lora_layer

        try:
            from peft.tuners.lora.variants import ALoraLinearVariant
        except ImportError:  # a PEFT without aLoRA
            ALoraLinearVariant = ()
        try:
            from peft.tuners.lora.variants import DoraEmbeddingVariant, DoraLinearVariant
        except ImportError:  # a PEFT without variants: DoRA has no variant object there
            DoraEmbeddingVariant = DoraLinearVariant = ()
        try:
            from peft.tuners.lora.dora import DoraEmbeddingLayer, DoraLinearLayer
            self.magnitudes = {True: (DoraLinearLayer,), False: (DoraEmbeddingLayer,)}
        except ImportError:  # pragma: no cover - a PEFT without DoRA
            self.magnitudes = {True: (), False: ()}
        nn = acc._torch.nn
        self.factor_type, self.dropout_types = nn.Linear, (nn.Dropout, nn.Identity)
        self.acc = acc
        self.linear, self.embedding = lora_layer.Linear, lora_layer.Embedding
        self.alora = ALoraLinearVariant
        self.dora = (DoraLinearVariant, DoraEmbeddingVariant)

    def layer(self, name, module):
        """A served `Layer` patched over `module` when it is of this kind, else None."""
        if type(module) in (self.linear, self.embedding):
            return Layer(self, name, module)
        return None

    def reason(self, module, names=None):
        """Why `module` cannot be served for the adapters `names` (None: every adapter it
        holds), or None.  Static reasons only (the configuration); the per-call ones are in
        Layer.reason."""
        linear = type(module) is self.linear
        adapters = names if names is not None else (
            list(module.lora_A) if linear else list(module.lora_embedding_A))
        for a in adapters:
            dora = module.use_dora.get(a, False)
            if dora:
                dora_layer = module.lora_magnitude_vector[a]
                embed_scale = getattr(module, "_get_embed_scale", None)
                if not linear and embed_scale is not None and embed_scale() is not None:
                    return f"adapter {a!r} uses DoRA on an embedding that scales its output"
                if linear and bool(getattr(dora_layer, "fan_in_fan_out", False)) != bool(
                        module.fan_in_fan_out):
                    return f"adapter {a!r}: its DoRA layer's fan_in_fan_out is not the layer's"
            if module.lora_bias.get(a, False):
                return f"adapter {a!r} has a lora_bias"
            variant = module.lora_variant.get(a)
            if variant is not None and not (linear and self.alora
                                            and isinstance(variant, self.alora)) \
                    and not (dora and isinstance(variant, self.dora)):
                return f"adapter {a!r} is a {type(variant).__name__} variant"
        if not linear:
            if getattr(module, "input_fns", None) or getattr(module, "output_fns", None):
                return "the embedding has tensor-parallel input/output hooks"
            if getattr(module.get_base_layer(), "max_norm", None) is not None:
                return "the embedding renormalises rows (max_norm)"
        return None
