"""embodied_jax: train and evaluate vision-language-action robot policies in JAX/Flax."""


def load_policy(ckpt_dir, **kwargs):
    """A trained policy bundle (parameters, statistics, tokenizer, input builder); see ``bundle``."""
    from embodied_jax.bundle import load_policy as _load

    return _load(ckpt_dir, **kwargs)
