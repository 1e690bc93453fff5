"""The loaders: `load_peft` (a PEFT adapter directory or safetensors file, `target_parameters`
experts included) and `load_gguf` (a llama.cpp LoRA GGUF), both returning a `LoraAdapter` (the
file's base names mapped to adapter kinds, one shared `LoraScale`)."""
