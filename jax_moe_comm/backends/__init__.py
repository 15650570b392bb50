"""Backends: `reference` (pure JAX, any platform) and `nvshmem` (CUDA kernels)."""
