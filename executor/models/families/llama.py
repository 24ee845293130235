"""Llama and Mistral: the decoder as it is (a sliding_window: Mistral's every layer)."""

from flagstop.executor.models.families.family import Architecture

ARCHITECTURES = (Architecture("LlamaForCausalLM"), Architecture("MistralForCausalLM"))
