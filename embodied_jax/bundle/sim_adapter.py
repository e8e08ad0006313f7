"""The adapter the simulator calls: a bundle as a jittable ``act(params, observation, rng)``.

``act_fn`` gives ``sim.Evaluator`` (and the in-training evaluation) the bundle's policy as a
function of its weights: the host pre- and post-processing a robot's request goes through
(``PolicyBundle.preprocess`` / ``postprocess``) run inside the compiled program through
``jax.pure_callback``, so evaluation exercises the same code as serving: the simulator's
``time_step`` (control steps since reset) reaches it as the observation's ``frame_index``, the
dataset's key for the same count (a collected episode's frame t is its control step t). With
real-time chunking the previous chunk's robot actions enter the model's action space inside the
program (``model_actions_fn``: the jnp inverse of ``postprocess``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.data.stats import normalize

if TYPE_CHECKING:
    from embodied_jax.bundle.policy_bundle import PolicyBundle

ActFn = Callable[[Any, dict[str, Any], jax.Array], jax.Array]  # (params, observation, rng) -> actions


def act_fn(
    bundle: PolicyBundle,
    instruction: str,
    camera_keys: Mapping[str, str] | None = None,
    *,
    rtc: bool = False,
    max_guidance: float = 5.0,
) -> tuple[ActFn, Any]:
    """``(act, params)`` for ``sim.Evaluator``: ``act(params, observation, rng)`` is jittable.

    ``observation`` = {"state": [B, S], "images": {camera: uint8 [B, H, W, 3]}, "time_step": [B]};
    camera ``c`` is the dataset key ``observation.images.c`` unless ``camera_keys`` says
    otherwise, and ``time_step`` (optional) is passed on as ``frame_index``. ``params`` are the
    bundle's weights; an evaluator compiled once can be called again with other weights of the
    same model (in-training evaluation).

    ``rtc``: ``act(params, observation, rng, prefix_actions, prefix_weights)`` samples with
    real-time chunking (``nn/rtc.py``, maximum guidance weight ``max_guidance``): ``prefix_actions``
    [B, H, A] are robot actions as ``act`` returns them (unnormalised, absolute), turned into the
    model's space here (delta dims relative to the observation's state, normalised with the run's
    action statistics); ``prefix_weights`` [H] or [B, H]. Both None: plain sampling.
    """
    camera_keys = dict(camera_keys or {})
    to_model_actions = model_actions_fn(bundle) if rtc else None

    def to_raw(state, images, time_step=None):
        raw = {bundle.inputs.state_key: np.asarray(state), "task": instruction}
        for cam, image in images.items():
            raw[camera_keys.get(cam, f"observation.images.{cam}")] = np.asarray(image)
        if time_step is not None:
            raw["frame_index"] = np.asarray(time_step)
        return raw

    def host_pre(state, images, *time_step):
        # The simulator renders at the evaluation's image size: resized like the dataset it collects.
        return bundle.preprocess(to_raw(state, images, *time_step), resize=True)

    def host_post(actions, state):
        return bundle.postprocess(np.asarray(actions), np.asarray(state)).astype(np.float32)

    def act_rtc(params, observation, rng, prefix_actions=None, prefix_weights=None):
        state, images = observation["state"], observation["images"]
        inputs = (state, images) + ((observation["time_step"],) if "time_step" in observation else ())
        example = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), inputs)
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_pre(*example))
        obs = jax.pure_callback(host_pre, spec, *inputs)
        model = bundle._merge(params)
        if prefix_actions is None:
            actions = model.sample_actions(obs, rng, prefix_weights=prefix_weights)  # refuses weights alone
        else:
            prefix = to_model_actions(prefix_actions, state)
            actions = model.sample_actions(
                obs, rng, prefix_actions=prefix, prefix_weights=prefix_weights, max_guidance=max_guidance
            )
        out_dim = bundle.action_dim or actions.shape[-1]
        out = jax.ShapeDtypeStruct((*actions.shape[:2], out_dim), jnp.float32)
        return jax.pure_callback(host_post, out, actions, state)

    def act(params, observation, rng):  # plain sampling: act_rtc without a prefix
        return act_rtc(params, observation, rng)

    return (act_rtc if rtc else act), bundle.params


def model_actions_fn(bundle: PolicyBundle) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``f(actions [B, H, A], state [B, S])``: robot actions in the model's action space, the
    jnp inverse of ``postprocess`` (delta dims made relative to the state, then normalised)."""
    key = bundle.inputs.action_key
    mode = None if bundle._unnormalizer is None else bundle._unnormalizer.modes.get(key)
    stats = bundle.stats.get(key)
    mask = None if bundle._delta_action_mask is None else np.asarray(bundle._delta_action_mask, bool)

    def to_model(actions, state):
        actions = jnp.asarray(actions, jnp.float32)
        width = bundle.action_dim or actions.shape[-1]
        if actions.ndim != 3 or actions.shape[-1] != width:
            raise ValueError(f"prefix_actions {actions.shape}: expected robot actions [B, H, {width}]")
        if mask is not None:
            dims = len(mask)
            offset = jnp.where(mask, jnp.asarray(state, jnp.float32)[:, :dims], 0.0)
            actions = actions.at[..., :dims].add(-offset[:, None, :])
        if mode is None:
            return actions
        return normalize(actions, stats, mode, key=key, xp=jnp)  # as the training pipeline did, in the program

    return to_model
