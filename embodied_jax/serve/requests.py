"""One request off the wire: decoded, checked and made ready for sampling, by itself.

``RequestReader.read(message)`` turns one binary message into the policy's prepared row
(``PolicyBundle.prepare_row``: checks and the per-sample transform, tokenisation included) and
its noise key; anything wrong with the message is an ``InputError`` naming the field. The
server runs it for each request alone, before the request joins a batch, so one request's
fault never reaches another's. ``error_text`` is the text frame every refusal travels in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from embodied_jax.bundle import ObservationError, PolicyBundle, PreparedRow, RtcPrefix, row_keys
from embodied_jax.serve import wire

MAX_ERROR_BYTES = 1024
MAX_NESTING = 4  # openpi's nested observation dicts are two levels deep
SEED_RANGE = (-(2**63), 2**63 - 1)


def error_text(text: str) -> str:
    """The text frame of a refusal: ``error: ...``, at most ``MAX_ERROR_BYTES`` of UTF-8."""
    encoded = f"error: {text}".encode()
    if len(encoded) <= MAX_ERROR_BYTES:
        return encoded.decode()
    return encoded[: MAX_ERROR_BYTES - 3].decode(errors="ignore") + "..."


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def canonical_observation(message: Mapping[str, Any]) -> dict[str, Any]:
    """The observation in the bundle's keys: nested dicts flattened with ".", "/" read as ".",
    ``prompt`` as ``task``."""
    # Iterative, not a recursive closure: a closure that refers to itself is a reference cycle
    # that would keep every request's arrays alive until the garbage collector runs.
    flat: dict[str, Any] = {}
    pending = [(message, "", 1)]
    while pending:
        node, prefix, depth = pending.pop()
        if depth > MAX_NESTING:
            raise ObservationError(f"{prefix.rstrip('.')}: observation maps nest deeper than {MAX_NESTING} levels")
        for key, value in node.items():
            if not isinstance(key, str):
                raise ObservationError(f"observation keys must be strings, got {type(key).__name__} {short(key)}")
            name = prefix + key.replace("/", ".")
            if isinstance(value, Mapping):
                pending.append((value, name + ".", depth + 1))
            else:
                flat[name] = value
    if "prompt" in flat and "task" not in flat:
        flat["task"] = flat.pop("prompt")
    return flat


class RequestReader:
    """Reads requests for ``bundle``: ``rtc`` accepts ``prefix_actions``/``inference_delay``;
    requests without a ``seed`` draw their noise from a key started at ``seed``."""

    def __init__(self, bundle: PolicyBundle, *, rtc: bool, max_task_chars: int, seed: int):
        self.bundle = bundle
        self.rtc = rtc
        self.max_task_chars = max_task_chars
        self._rng = jax.random.key(seed)

    def read(self, message: bytes) -> tuple[PreparedRow, jax.Array]:
        """Decode, check and transform one request (the server's preparation thread)."""
        decoded = wire.unpackb(message)
        if not isinstance(decoded, Mapping):
            raise ObservationError(f"expected one observation (a map of keys to values), got {type(decoded).__name__}")
        observation = canonical_observation(decoded)
        task = observation.get("task")
        if isinstance(task, str) and len(task) > self.max_task_chars:
            raise ObservationError(
                f"task: {len(task)} characters, more than the {self.max_task_chars} accepted (--max-task-chars)"
            )
        key = self._key(observation)
        prefix = self._prefix(observation)
        return self.bundle.prepare_row(observation, prefix, guided=self.rtc), key

    def _key(self, observation: dict[str, Any]) -> jax.Array:
        seed = observation.pop("seed", None)
        if seed is None:
            self._rng, key = jax.random.split(self._rng)
            return key
        if isinstance(seed, (bool, np.bool_, float)) or not isinstance(seed, (int, np.integer)):
            raise ObservationError(f"seed: expected an integer, got {type(seed).__name__} {short(seed)}")
        lo, hi = SEED_RANGE
        if not lo <= int(seed) <= hi:
            raise ObservationError(f"seed: expected an integer in [-2**63, 2**63 - 1], got {short(int(seed))}")
        return row_keys(jax.random.key(int(seed)), 1)[0]  # what predict(observation, rng=key(seed)) uses

    def _prefix(self, observation: dict[str, Any]) -> RtcPrefix | None:
        actions, delay = observation.pop("prefix_actions", None), observation.pop("inference_delay", None)
        if actions is None and delay is None:
            return None
        if not self.rtc:
            raise ObservationError("prefix_actions/inference_delay: this server was started without --rtc")
        if actions is None:
            raise ObservationError("inference_delay: given without prefix_actions")
        if isinstance(delay, (bool, np.bool_, float)) or not isinstance(delay or 0, (int, np.integer)):
            raise ObservationError(f"inference_delay: expected an integer, got {short(delay)}")
        if not isinstance(actions, np.ndarray) or actions.dtype.kind != "f":
            raise ObservationError("prefix_actions: expected a float32 array [P, A]")
        prefix = RtcPrefix(actions, int(delay or 0))
        prefix.check(*self.bundle.action_shape)
        return prefix
