"""gpumemd: the per-GPU memory daemon (``gpumemd --device N``)."""
