"""Shared layers (Flax NNX): segment-id attention, norms, RoPE, MLPs, embeddings,
Dense/Einsum with FP8, layer stacks (scan/remat) and LoRA. Every parameter carries
logical axis names from ``embodied_jax.parallel.rules``."""
