"""A bundle's pre- and post-processing as jnp functions: observations in and actions out of a
jitted program (reinforcement-learning rollouts) with no host round trip per step.

``device_io(bundle, instruction, camera_keys)`` owns the in-program form of what a robot's
request goes through on the host (``PolicyBundle.preprocess(raw, resize=True)`` and
``postprocess``): the run's per-sample transform (``data/sample_transform.py``: the state
normalised with ``data.stats.normalize(..., xp=jnp)``, images to [-1, 1] with
``nn.image.to_unit_range(..., xp=jnp)``, renamed) and the model's input builder, for one
instruction; actions back through ``data.stats.unnormalize`` and ``data.samples.to_absolute_actions``
(``xp=jnp``). Everything constant for the instruction is made once on the host here: GR00T's
Eagle prompt tokens; π0.5's prompt around its discretised state (``bundle/pi05_prompt.py``): its fixed
head and, for every state bin, that bin's tokens (between bins, and as the last one with the
prompt's tail), assembled per row in the program (a fixed-size gather compacted with a
cumulative sum, truncated and padded to ``max_token_len`` as the host does), the bins counted
against per-dimension thresholds on the raw state that reproduce the host's float64
normalisation exactly. That assembly is checked here against the builder's own tokens for probe
states (normalised to every bin 0, every bin 255, every bin -1, a random mix; values on and just
below bin edges); a tokenizer that merges text across those pieces (SentencePiece joins
consecutive unknown words into one ``<unk>``) fails the check, and then the tokens alone come
from the host through ``jax.pure_callback`` (a logged warning; ``DeviceIO.host_tokens``).

``bundle`` may not import ``models``: the builders are reached through the bundle's transform,
each family's form below follows its builder (``models/pi05/inputs.py``,
``models/gr00t/inputs.py``), and the probe check guards π0.5's copy of the prompt's layout.

Not expressible, a ``DeviceIOError`` (an ``InputError``) naming what is missing, when
``device_io`` is built or its functions traced: another input builder, statistics missing for a
normalised key, images of another size than the run's (the host resizes through swscale, which
no jnp resize reproduces: render at the run's image size), float images (``ObservationError``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.bundle.front import DeviceIOError, Front
from embodied_jax.bundle.observation import ObservationError
from embodied_jax.bundle.pi05_prompt import Pi05Prompt, host_prompt_tokens, pad_state
from embodied_jax.bundle.sim_adapter import model_actions_fn
from embodied_jax.data.samples import to_absolute_actions
from embodied_jax.data.stats import unnormalize
from embodied_jax.nn.image import to_unit_range

if TYPE_CHECKING:
    from embodied_jax.bundle.policy import PolicyBundle

log = logging.getLogger(__name__)

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

    ``host_tokens``: π0.5's prompt tokens come from the host (``jax.pure_callback``) because the
    tokenizer merges across the prompt's pieces (the module docstring)."""

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
    form = _FORMS.get(type(builder).__name__)
    if form is None:
        raise DeviceIOError(
            f"no in-program form of the input builder {type(builder).__name__}: device_io knows "
            f"{sorted(_FORMS)} (the π0.5 and GR00T builders)"
        )
    if getattr(builder, "packed", False):
        raise DeviceIOError(f"{type(builder).__name__} builds packed samples: the bundle's builder must be unpacked")
    front = Front.of(bundle)
    row, host_tokens = form(builder, instruction, front)
    observe = _observe(front, row, host_tokens, dict(camera_keys or {}))
    return DeviceIO(observe, _act_fn(bundle), model_actions_fn(bundle), host_tokens is not None)


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


# ----------------------------------------------------------------------------- the families' builders


def _check_size(slot: str, image: jax.Array, size: tuple[int, int] | None, builder: str) -> None:
    if size is not None and tuple(image.shape[:2]) != tuple(size):
        raise DeviceIOError(
            f"camera slot {slot!r}: images of {image.shape[0]}x{image.shape[1]} reach the {builder} builder, "
            f"which takes {size[0]}x{size[1]} (it would resize on the host): set the data's image_size to "
            "the model's"
        )


def _gr00t(builder, instruction: str, front: Front):
    """GR00T (``Gr00tInputBuilder``): the prompt is fixed per instruction; state padded; every
    camera present; images as the data layer made them."""
    slots = [slot for _, slot in front.cameras]
    lacking = [c for c in builder.camera_names if c not in slots]
    if lacking:
        raise DeviceIOError(
            f"GR00T reads cameras {list(builder.camera_names)}; the run's inputs give none for {lacking}"
        )
    tokens, token_mask = builder.tokenize(instruction)  # PromptError names a task it cannot take
    tokens, token_mask = np.asarray(tokens, np.int32), np.asarray(token_mask, bool)
    size = None if builder.image_size is None else (builder.image_size, builder.image_size)
    embodiment = np.int32(builder.embodiment_id)

    def row(state, images):
        state, images = front.state(state), front.images(images)
        for slot in builder.camera_names:
            _check_size(slot, images[slot], size, "GR00T")
        return {
            "state": pad_state(state.reshape(-1), builder.max_state_dim),
            "embodiment_id": jnp.asarray(embodiment),
            "tokens": jnp.asarray(tokens),
            "token_mask": jnp.asarray(token_mask),
            "images": {c: to_unit_range(images[c], xp=jnp) for c in builder.camera_names},
            "image_masks": {c: jnp.asarray(True) for c in builder.camera_names},
        }

    return row, None


def _pi05(builder, instruction: str, front: Front):
    """π0.5 (``Pi05InputBuilder``): the prompt holds the discretised state (``bundle/pi05_prompt.py``);
    cameras the run lacks are -1 and masked; images read with ``floats="auto"``."""
    prompt = Pi05Prompt.build(builder, instruction, front)
    host_tokens = None
    if not prompt.verify(builder, instruction, front):
        log.warning(
            "device_io: the tokenizer %s merges text across the π0.5 prompt's pieces (the in-program "
            "assembly differs from its own encoding): the prompt tokens come from the host through "
            "jax.pure_callback on every call",
            getattr(builder.tokenizer, "path", type(builder.tokenizer).__name__),
        )
        host_tokens = host_prompt_tokens(builder, instruction, front)
    size = tuple(builder.image_size)

    def row(raw_state, images):
        state, given = front.state(raw_state), front.images(images)
        images, masks = {}, {}
        for cam in builder.camera_names:
            if cam in given:
                images[cam] = to_unit_range(given[cam], floats="auto", xp=jnp)
                _check_size(cam, images[cam], size, "π0.5")
                masks[cam] = jnp.asarray(True)
            else:
                images[cam] = jnp.full((*size, 3), -1.0, jnp.float32)
                masks[cam] = jnp.asarray(False)
        out = {"images": images, "image_masks": masks, "state": pad_state(state, builder.max_state_dim)}
        if host_tokens is None:
            out["tokens"], out["token_mask"] = prompt.tokens(raw_state)
        return out

    return row, host_tokens


_FORMS = {"Pi05InputBuilder": _pi05, "Gr00tInputBuilder": _gr00t}
