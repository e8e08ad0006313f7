"""Training: config, train state, optimizer, jitted step, loop, checkpoints, metrics.

Generic over the Policy contract (``embodied_jax.policy``); never imports a concrete model.
"""
