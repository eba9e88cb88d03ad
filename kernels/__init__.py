"""Kernels: Triton (GPU, one per file with a torch reference beside it) and native CPU ones."""
