"""A bundle's pre- and post-processing as jnp functions: observations in and actions out of a
jitted program (reinforcement-learning rollouts) with no host round trip per step.

``device_io(bundle, instruction, camera_keys)`` owns the in-program form of what a robot's
request goes through on the host (``PolicyBundle.preprocess(raw, resize=True)`` and
``postprocess``): the run's per-sample transform (``data/sample_transform.py``: the state
normalised with ``data.stats.normalize(..., xp=jnp)``, images to [-1, 1] with
``images.to_unit_range(..., xp=jnp)``, renamed) and the model's input builder, for one
instruction; actions back through ``data.stats.unnormalize`` and ``data.samples.to_absolute_actions``
(``xp=jnp``). The model's part is its family's: the builder's in-program form
(``policy.InProgramBuilder.in_program``, in ``models/<family>/inputs.py``), given the transform's
front (``bundle/front.py``); this module knows no family. π0.5's form may take its prompt tokens
from the host (``jax.pure_callback``; ``DeviceIO.host_tokens``) when its tokenizer merges text
across the prompt's pieces.

Not expressible, a ``DeviceIOError`` (an ``InputError``) naming what is missing, when
``device_io`` is built or its functions traced: a builder without an in-program form, statistics missing for a
normalised key, images of another size than the run's (the host resizes through swscale, which
no jnp resize reproduces: render at the run's image size), float images (``ObservationError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from embodied_jax.bundle.front import Front
from embodied_jax.bundle.sim_adapter import model_actions_fn
from embodied_jax.data.samples import to_absolute_actions
from embodied_jax.data.stats import unnormalize
from embodied_jax.errors import DeviceIOError, ObservationError
from embodied_jax.policy import InProgramBuilder

if TYPE_CHECKING:
    from embodied_jax.bundle.policy_bundle import PolicyBundle

Observe = Callable[..., dict[str, Any]]
ActionsFn = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class DeviceIO:
    """A bundle's processing for one instruction, as pure jnp functions (jittable, vmappable):

    - ``observe(state [B, S], images {camera: uint8 [B, H, W, 3]})``: the model's observation
      batch, the dict ``bundle.preprocess(raw, resize=True)`` returns for the raw observation
      ``{state_key: state, "task": instruction, camera key: image, ...}`` (its keys, shapes,
      dtypes; values equal up to float32 rounding; tokens exactly); ``observe(observation)``
      takes the simulator's observation dict ``{"state", "images", ...}`` alike (other keys,
      such as ``time_step``, are not read: the transform reads no time keys);
    - ``act(model_actions [B, H, A_pad], state [B, S])``: robot actions [B, H, A] float32, as
      ``bundle.postprocess``;
    - ``to_model(robot_actions [B, H, A], state [B, S])``: robot actions in the model's action
      space (``sim_adapter.model_actions_fn``: what real-time chunking guides with).

    ``host_tokens``: the prompt's tokens come from the host (``jax.pure_callback``): the family's
    form could not assemble them in the program (the module docstring)."""

    observe: Observe
    act: ActionsFn
    to_model: ActionsFn
    host_tokens: bool = False


def device_io(bundle: PolicyBundle, instruction: str, camera_keys: Mapping[str, str] | None = None) -> DeviceIO:
    """The bundle's pre- and post-processing for ``instruction`` as jnp functions (``DeviceIO``).

    Camera ``c`` of ``observe``'s images is the dataset key ``observation.images.c`` unless
    ``camera_keys`` maps it to another (as ``sim_adapter.act_fn``); cameras the run does not read
    are ignored, a missing one is an ``ObservationError`` when ``observe`` is traced."""
    if not isinstance(instruction, str):
        raise DeviceIOError(f"instruction: expected a str, got {type(instruction).__name__}")
    transform = bundle.transform
    inputs = transform.inputs
    if inputs is None:
        raise DeviceIOError("the run's transform renames no keys (no ModelInputs): its model inputs are not fixed")
    if transform.images.augment is not None:
        raise DeviceIOError("the bundle's transform augments images (a training transform): nothing to serve")
    builder = transform.builder
    if not isinstance(builder, InProgramBuilder):
        raise DeviceIOError(
            f"no in-program form of the input builder {type(builder).__name__}: its family's builder "
            "defines no in_program (policy.InProgramBuilder)"
        )
    if getattr(builder, "packed", False):
        raise DeviceIOError(f"{type(builder).__name__} builds packed samples: the bundle's builder must be unpacked")
    front = Front.of(bundle)
    form = builder.in_program(instruction, front)
    observe = _observe(front, form.row, form.host_tokens, dict(camera_keys or {}))
    return DeviceIO(observe, _act_fn(bundle), model_actions_fn(bundle), form.host_tokens is not None)


# ----------------------------------------------------------------------------- the per-sample transform


def _observe(front: Front, row, host_tokens, camera_keys: dict[str, str]) -> Observe:
    def observe(state, images=None):
        if images is None and isinstance(state, Mapping):  # the simulator's observation dict
            state, images = state["state"], state["images"]
        state = jnp.asarray(state)
        if state.ndim != 2 or state.dtype.kind not in "fiu":
            raise ObservationError(
                f"{front.state_key}: expected real-valued states [B, S], got {state.dtype}{state.shape}"
            )
        if front.state_dim is not None and state.shape[-1] != front.state_dim:
            raise ObservationError(
                f"{front.state_key}: expected {front.state_dim} values per state (the run's state), got {state.shape}"
            )
        by_key = {camera_keys.get(cam, f"observation.images.{cam}"): jnp.asarray(x) for cam, x in images.items()}
        missing = [key for key, _ in front.cameras if key not in by_key]
        if missing:
            raise ObservationError(
                f"images lack the dataset cameras {missing} (given {sorted(images)} as {sorted(by_key)}; "
                "camera_keys maps a simulator camera to a dataset key)"
            )
        by_key = {key: by_key[key] for key, _ in front.cameras}
        for key, image in by_key.items():
            if image.dtype != jnp.uint8 or image.ndim != 4 or image.shape[-1] != 3 or image.shape[0] != state.shape[0]:
                raise ObservationError(
                    f"{key}: expected uint8 images [{state.shape[0]}, H, W, 3] (one per state), got "
                    f"{image.dtype}{image.shape}"
                )
        out = jax.vmap(row)(state, by_key)
        if host_tokens is not None:
            out["tokens"], out["token_mask"] = host_tokens(state)
        return out

    return observe


# ----------------------------------------------------------------------------- actions out


def _act_fn(bundle: PolicyBundle) -> ActionsFn:
    """``postprocess`` in jnp: the real action dims, unnormalised, delta dims made absolute."""
    key = bundle.inputs.action_key
    unnormalizer = bundle._unnormalizer
    mode = None if unnormalizer is None else unnormalizer.modes.get(key)
    stats = bundle.stats.get(key)
    if mode is not None and stats is None:
        raise DeviceIOError(f"norm_stats has no statistics for {key!r} ({mode} normalisation)")
    mask = bundle._delta_action_mask
    width = bundle.action_dim

    def one(actions, state):
        if mode is not None:
            actions = unnormalize(actions, stats, mode, key=key, xp=jnp)
        if mask is not None:
            actions = to_absolute_actions(actions, state, mask, xp=jnp)
        return actions

    def act(actions, state):
        actions = jnp.asarray(actions, jnp.float32)
        if actions.ndim != 3:
            raise ValueError(f"model actions {actions.shape}: expected [B, H, A]")
        if width is not None:
            actions = actions[..., :width]
        state = jnp.asarray(state, jnp.float32).reshape(actions.shape[0], -1)
        return jax.vmap(one)(actions, state).astype(jnp.float32)

    return act
