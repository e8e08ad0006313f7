"""Seeds by purpose, for the built-in tasks and Meta-World alike: the scenes demonstrations are
collected in, the scenes settings are chosen on and the scenes reported figures come from never
coincide.

A built-in task's episodes come from ``jax.random.key(seed)`` split per batch and world; a
Meta-World episode ``i`` of task ``T`` resets with ``metaworld.episode_seed(seed, T, i)``. Each
purpose has its own seed, so its scenes are drawn from a stream no other purpose reads
(``tests/test_sim_evaluate.py`` and ``tests/test_sim_metaworld.py`` check that none coincide).
"""

COLLECTION_SEED = 0  # scripted demonstrations (sim.collect, the experiments' datasets)
TEST_SEED = 1  # reported figures: ``evaluate``'s default and the experiments' final evaluations
VALIDATION_SEED = 2  # in-training evaluations, ablations, anything that chooses a setting
CALIBRATION_SEED = 1000  # DART noise calibration of the scripted experts
RL_SEED = 3  # Meta-World's reinforcement-learning rollouts (sim.metaworld.MetaWorldBatch)

PURPOSES = {
    "collection": COLLECTION_SEED,
    "test": TEST_SEED,
    "validation": VALIDATION_SEED,
    "calibration": CALIBRATION_SEED,
    "reinforcement learning": RL_SEED,
}
