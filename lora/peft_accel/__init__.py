"""`accelerate_peft`: a PEFT model's LoRA layers served by the kernels.  The model scan and
patching (`accelerate`); the served layer every kind derives from (`served`); PEFT's LoRA Linear
/ Embedding layers as a kind (`lora_kind`), their full path (`lora_layer`), their short path
(`lora_plan`) and PEFT's rules they keep (`lora_rules`); transformers' MoE experts layers
(`experts`); the custom op a served layer traces to under torch.compile (`torch_op`).  What this
package knows of PEFT and transformers stays here; the core never imports it."""
