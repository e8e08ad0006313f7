"""Policy bundles: a trained model as the policy a robot (or the simulator) runs.

A ``PolicyBundle`` holds the run's config, the model, the normalisation statistics and
the run's per-sample transform (``DataSource.serving_transform``: the very
``SampleTransform`` the Grain pipeline applied to every training sample, without
augmentation). ``predict(raw)`` takes a robot's raw observation in dataset keys::

    {"observation.state": float [S],
     "observation.images.<camera>": uint8 [H, W, 3],
     "task": str}

or a batch of them (a leading B on every array; ``task`` one str or B of them), applies
that transform on the host, samples action chunks with one jitted call and returns them
unnormalised and absolute (delta actions turned back): [horizon, action_dim] for one
observation, [B, horizon, action_dim] for a batch. Every key, shape, dtype and value
range, and each ``ObservationError``, is described in ``docs/observations.md``.

``act_fn(bundle, instruction)`` gives the simulator's evaluator a jittable ``act(params,
observation, rng) -> [B, H, A]`` and the parameters to call it with; the host
preprocessing runs inside the compiled program through ``jax.pure_callback``, so
evaluation exercises the same code as serving. ``device_io.device_io(bundle, instruction)``
gives the same pre- and post-processing as jnp functions instead (``DeviceIO``: ``observe``,
``act``, ``to_model``), for rollouts with no host round trip per step. ``embodied_jax.load_policy``
makes a bundle from a checkpoint.
"""

from embodied_jax.bundle.device_io import DeviceIO, DeviceIOError
from embodied_jax.bundle.observation import NormStatsError, ObservationError, RtcPrefix
from embodied_jax.bundle.policy_bundle import PolicyBundle, PreparedRow, row_keys
from embodied_jax.bundle.sim_adapter import ActFn, act_fn, model_actions_fn

__all__ = [
    "ActFn",
    "act_fn",
    "model_actions_fn",
    "DeviceIO",
    "DeviceIOError",
    "NormStatsError",
    "ObservationError",
    "PolicyBundle",
    "PreparedRow",
    "RtcPrefix",
    "row_keys",
]
