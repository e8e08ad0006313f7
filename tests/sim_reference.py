"""The reference rollout of the sim tests: 64 expert worlds and 8 random-policy worlds in one batch.

``test_sim_tasks`` and ``test_sim_evaluate`` build it identically, so the session's
compilation cache compiles each task's rollout once for both.
"""

import numpy as np

from embodied_jax.sim import rollout as rollout_lib

EXPERT_EPISODES, RANDOM_EPISODES = 64, 8
BATCH = EXPERT_EPISODES + RANDOM_EPISODES


def reference_rollout(env):
    """``rollout(rng) -> Trajectory``: worlds [0, 64) follow the expert, the rest act randomly."""
    policy = rollout_lib.mixed_policy(
        rollout_lib.expert_policy(env), rollout_lib.random_policy(env), np.arange(BATCH) >= EXPERT_EPISODES
    )
    return rollout_lib.make_rollout(env, policy, BATCH)
