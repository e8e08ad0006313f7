"""The policy server: one loaded policy, many websocket clients, requests batched per call.

Protocol (openpi's, so an unmodified ``openpi_client.WebsocketClientPolicy`` connects): on
connect the server sends its metadata; then each binary message is one unbatched observation
(msgpack-numpy, ``wire.py``) and is answered with ``{"actions": float32 [H, A],
"server_timing": {"infer_ms", "batch_size", "queue_ms"}}``. A request that cannot be served
(a missing key, a wrong shape or dtype, a non-finite state, a malformed or oversized message)
is answered with a text frame naming the field and what was expected; the connection stays
open and other clients are not affected. ``GET /healthz`` answers 200 on the same port.

Observation keys are the bundle's (``docs/observations.md``): ``observation.state``,
``observation.images.<camera>``, ``task``. openpi's spellings are accepted too: flat
``observation/state`` keys, nested dicts (``{"observation": {"images": {...}}}``, ALOHA style)
and ``prompt`` for ``task``. An optional integer ``seed`` fixes the request's noise; without
one each request draws fresh noise from the server's key. With ``--rtc`` a request may also
carry ``prefix_actions`` (float32 [P, A]: the previous chunk's actions from the new chunk's first
step on) and ``inference_delay`` (how many of them execute while it is sampled): the new chunk
is sampled by real-time chunking (``nn/rtc.py``) to agree with them.

Batching: requests arriving within ``batch_timeout_ms`` of the first are served by one call of
up to ``max_batch`` observations, padded to the next compiled bucket (1, 2, 4, ...,
``max_batch``; all compiled before the server accepts connections). Each row's noise comes from
its own key, so a request's actions do not depend on what it was batched with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import http
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import websockets
from websockets.asyncio.server import Request, Response, ServerConnection, serve

from embodied_jax.bundle import ObservationError, PolicyBundle, RtcPrefix, row_keys
from embodied_jax.serve import wire

log = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    batch_timeout_ms: float = 5.0
    api_key: str | None = None
    max_message_mb: float = 32.0
    seed: int = 0  # of the key requests without a ``seed`` draw their noise from
    rtc: bool = False  # real-time chunking: requests may carry ``prefix_actions`` and ``inference_delay``


def buckets(max_batch: int) -> tuple[int, ...]:
    """The compiled batch sizes: powers of two below ``max_batch``, and ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be >= 1")
    sizes = [2**i for i in range(int(math.log2(max_batch)) + 1) if 2**i < max_batch]
    return (*sizes, max_batch)


def canonical_observation(message: Mapping[str, Any]) -> dict[str, Any]:
    """The observation in the bundle's keys: nested dicts flattened with ".", "/" read as ".",
    ``prompt`` as ``task``."""
    flat: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if not isinstance(key, str):
                raise ObservationError(f"observation keys must be strings, got {key!r}")
            name = prefix + key.replace("/", ".")
            if isinstance(value, Mapping):
                walk(value, name + ".")
            else:
                flat[name] = value

    walk(message, "")
    if "prompt" in flat and "task" not in flat:
        flat["task"] = flat.pop("prompt")
    return flat


@dataclasses.dataclass
class _Request:
    observation: dict[str, Any]
    key: jax.Array
    prefix: RtcPrefix | None
    future: asyncio.Future
    received: float


class PolicyServer:
    """Serves ``bundle`` with ``config``; ``run()`` until ``stop()`` (or SIGTERM in ``main``)."""

    def __init__(self, bundle: PolicyBundle, config: ServeConfig = ServeConfig()):
        self.bundle = bundle
        self.config = config
        self.buckets = buckets(config.max_batch)
        self.spec = bundle.observation_spec()
        self.metadata = {
            "observation": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.spec.items()},
            "action": {"shape": list(bundle.action_shape), "dtype": "float32"},
            "model": type(bundle.config.model).__name__,
            "step": int(bundle.step),
            "rtc": config.rtc,
        }
        self._rng = jax.random.key(config.seed)
        self._queue: asyncio.Queue[_Request] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy")
        self._stopped: asyncio.Event | None = None
        self.port: int | None = None
        self.served = 0
        self.refused = 0

    # ------------------------------------------------------------------ inference
    def example_observation(self) -> dict[str, Any]:
        """A well-formed observation of zeros (warm-up)."""
        example = {}
        for key, (shape, dtype) in self.spec.items():
            example[key] = "warm up" if dtype == "str" else np.zeros(shape, np.dtype(dtype))
        return example

    def warm_up(self) -> None:
        """Compile every bucket before accepting connections."""
        example = self.example_observation()
        for size in self.buckets:
            t0 = time.perf_counter()
            keys = jax.random.split(jax.random.key(0), size)
            self.bundle.predict_rows([example] * size, keys, prefixes=[None] * size if self.config.rtc else None)
            log.info("bucket %d compiled in %.1f s", size, time.perf_counter() - t0)

    def _infer(self, requests: list[_Request]) -> tuple[np.ndarray, float]:
        size = next(b for b in self.buckets if b >= len(requests))
        rows = requests + [requests[0]] * (size - len(requests))
        t0 = time.perf_counter()
        prefixes = [r.prefix for r in rows] if self.config.rtc else None
        actions = self.bundle.predict_rows(
            [r.observation for r in rows], jax.numpy.stack([r.key for r in rows]), prefixes=prefixes
        )
        return np.asarray(actions[: len(requests)], np.float32), (time.perf_counter() - t0) * 1e3

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.config.batch_timeout_ms / 1e3
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + timeout
            while len(batch) < self.config.max_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
            batch = [r for r in batch if not r.future.done()]  # a client that left loses only its answer
            if not batch:
                continue
            try:
                actions, infer_ms = await loop.run_in_executor(self._executor, self._infer, batch)
            except Exception as e:  # a failed call fails its requests, never the server
                log.exception("inference failed for a batch of %d", len(batch))
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            done = time.perf_counter()
            for row, r in zip(actions, batch, strict=True):
                if not r.future.done():
                    timing = {"infer_ms": infer_ms, "batch_size": len(batch), "queue_ms": (done - r.received) * 1e3}
                    r.future.set_result((row, timing))

    # ------------------------------------------------------------------ connections
    def _request_key(self, observation: dict[str, Any]) -> jax.Array:
        seed = observation.pop("seed", None)
        if seed is None:
            self._rng, key = jax.random.split(self._rng)
            return key
        if isinstance(seed, (bool, float)) or not isinstance(seed, (int, np.integer)):
            raise ObservationError(f"seed: expected an integer, got {type(seed).__name__} {seed!r}")
        return row_keys(jax.random.key(int(seed)), 1)[0]  # what predict(observation, rng=key(seed)) uses

    def _prefix(self, observation: dict[str, Any]) -> RtcPrefix | None:
        actions, delay = observation.pop("prefix_actions", None), observation.pop("inference_delay", None)
        if actions is None and delay is None:
            return None
        if not self.config.rtc:
            raise ObservationError("prefix_actions/inference_delay: this server was started without --rtc")
        if actions is None:
            raise ObservationError("inference_delay: given without prefix_actions")
        if isinstance(delay, (bool, float)) or not isinstance(delay or 0, (int, np.integer)):
            raise ObservationError(f"inference_delay: expected an integer, got {delay!r}")
        prefix = RtcPrefix(np.asarray(actions), int(delay or 0))
        prefix.check(*self.bundle.action_shape)
        return prefix

    def _parse(self, message: bytes | str) -> tuple[dict[str, Any], jax.Array, RtcPrefix | None]:
        if isinstance(message, str):
            raise wire.WireError("expected a binary msgpack-numpy message, got a text frame")
        limit = int(self.config.max_message_mb * 2**20)
        if len(message) > limit:
            raise wire.WireError(f"message of {len(message)} bytes exceeds the {limit}-byte limit (--max-message-mb)")
        decoded = wire.unpackb(message)
        if not isinstance(decoded, Mapping):
            raise ObservationError(f"expected one observation (a map of keys to values), got {type(decoded).__name__}")
        observation = canonical_observation(decoded)
        key = self._request_key(observation)
        prefix = self._prefix(observation)
        self.bundle.check_observation(observation, batched=False)
        return observation, key, prefix

    async def _handler(self, connection: ServerConnection) -> None:
        await connection.send(wire.packb(self.metadata))
        loop = asyncio.get_running_loop()
        try:
            async for message in connection:
                received = time.perf_counter()
                try:
                    observation, key, prefix = self._parse(message)
                except (ObservationError, wire.WireError) as e:
                    self.refused += 1
                    await connection.send(f"error: {e}")
                    continue
                future = loop.create_future()
                await self._queue.put(_Request(observation, key, prefix, future, received))
                try:
                    actions, timing = await future
                except Exception as e:
                    self.refused += 1
                    await connection.send(f"error: inference failed: {type(e).__name__}: {e}")
                    continue
                self.served += 1
                await connection.send(wire.packb({"actions": actions, "server_timing": timing}))
        except websockets.ConnectionClosed:
            pass  # the client left; its pending answer (if any) is dropped

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        if self.config.api_key is not None:
            if request.headers.get("Authorization") != f"Api-Key {self.config.api_key}":
                return connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")
        return None

    async def run(self, ready: Callable[[PolicyServer], None] | None = None) -> None:
        """Serve until ``stop()``; ``ready(self)`` once the port is bound (``self.port``)."""
        self._queue = asyncio.Queue()
        self._stopped = asyncio.Event()
        if self.config.host not in LOCAL_HOSTS and self.config.api_key is None:
            log.warning(
                "serving on %s without an API key: any host that reaches it can query the policy "
                "(--api-key KEY or EMBODIED_JAX_API_KEY)",
                self.config.host,
            )
        # Oversized messages are refused by ``_parse`` with a named error; the transport limit
        # only stops a client from exhausting memory.
        transport_limit = 4 * int(self.config.max_message_mb * 2**20)
        async with serve(
            self._handler,
            self.config.host,
            self.config.port,
            compression=None,
            max_size=transport_limit,
            process_request=self._process_request,
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            batcher = asyncio.create_task(self._batcher())
            if ready is not None:
                ready(self)
            await self._stopped.wait()
            batcher.cancel()
        self._executor.shutdown(wait=True)

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()
