"""Attention and cache kernels: Triton for CUDA, torch reference twins for the CPU."""
