"""embodied_jax: train and evaluate vision-language-action robot policies in JAX/Flax."""
