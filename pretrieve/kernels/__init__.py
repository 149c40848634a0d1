"""Two-stream masked attention for RetroMAE-style decoders: the reference (here) and fused kernels."""
