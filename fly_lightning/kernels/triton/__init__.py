"""Triton kernels (NVIDIA and ROCm GPUs; CPU through ``TRITON_INTERPRET=1`` for tests)."""
