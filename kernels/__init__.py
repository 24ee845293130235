"""Kernels: Triton for CUDA (triton_*.py), and their torch twins (torch_*.py), the CPU
path and the Triton kernels' oracle."""
