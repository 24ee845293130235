"""Model definitions: a compact Llama family (Llama, Mistral, Qwen2, Qwen3)."""
