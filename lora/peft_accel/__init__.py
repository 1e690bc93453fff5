"""`accelerate_peft`: a PEFT model's LoRA layers served by the kernels.  The model scan and
patching (`accelerate`), the served-layer base class, PEFT's LoRA Linear / Embedding layers and
their short path, and transformers' MoE experts layers (`_accel_experts`).  What this package
knows of PEFT and transformers stays here; the core never imports it."""
