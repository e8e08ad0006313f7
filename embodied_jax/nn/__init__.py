"""Shared layers (Flax NNX): segment-id attention (dense reference, block-sparse for packed
rows, a Pallas GPU kernel), norms, RoPE, MLPs, embeddings, Dense/Einsum with FP8, layer
stacks (scan/remat), LoRA and analytic FLOP counts. Every parameter carries
logical axis names from ``embodied_jax.parallel.rules``. Also: host-side image preprocessing
shared by ``data`` and the models' input builders (``image``; the two may import ``nn``, not
each other) and running an NNX module inside raw JAX loops and traces (``traced``)."""
