"""Reinforcement learning of the flow policies in the batched simulator (``docs/rl.md``).

PPO over chunk-level decisions through the Flow-SDE sampler of ``nn/flow.py``: rollouts
(reset, rendering, the policy's pre-processing, chunk sampling, physics, bookkeeping) are one
jitted program for the whole batch of environments, sharded over the mesh's data axis; the
update is another. Modules: ``advantages`` (GAE, group-normalised success), ``critic`` (the
value network), ``agent`` (a policy as pure functions of its trainable weights), ``rollout``,
``ppo`` (the loss and the update step), ``toy`` (a pure-JAX reaching task for tests),
``config`` (pure data), ``checkpoint`` (a run's RL state beside a loadable policy), ``loop``.
"""
