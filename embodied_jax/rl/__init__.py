"""Reinforcement learning of the flow policies in the batched simulator (``docs/rl.md``).

PPO over chunk-level decisions through the Flow-SDE sampler of ``nn/flow.py``: rollouts
(reset, rendering, the policy's pre-processing, chunk sampling, physics, bookkeeping) are one
jitted program for the whole batch of environments, sharded over the mesh's data axis; the
update is another; Meta-World's environments are stepped on the host instead, one jitted policy
call per decision. Modules: ``advantages`` (GAE, group-normalised success), ``critic`` (the
value network, of the robot state and the simulator's privileged state), ``agent`` (a policy as
pure functions of its weights), ``scope`` (which weights train: the action expert by default),
``rollout`` (in the program), ``host_rollout`` (environments stepped on the host),
``diagnostics``, ``ppo`` (the loss and the update step), ``toy`` (a pure-JAX reaching task for
tests), ``config`` (pure data), ``start``, ``checkpoint`` (a run's RL state beside a loadable
policy), ``loop``.
"""
