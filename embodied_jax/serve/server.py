"""The policy server: one loaded policy, many websocket clients, requests batched per call.

Protocol (openpi's, so an unmodified ``openpi_client.WebsocketClientPolicy`` connects): on
connect the server sends its metadata; then each binary message is one unbatched observation
(msgpack-numpy, ``wire.py``) and is answered with ``{"actions": float32 [H, A],
"server_timing": {"infer_ms", "batch_size", "queue_ms"}}``. A request that cannot be served
(a missing key, a wrong shape or dtype, a non-finite state, a malformed or oversized message)
is answered with a text frame (at most 1 KiB) naming the field and what was expected; the
connection stays open and other clients are not affected. ``GET /healthz`` answers 200 on the
same port.

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

One request's fault stays its own: decoding, checks and the per-sample transform
(tokenisation included) run for each request alone, off the event loop, before it joins a
batch (``PolicyBundle.prepare_row``); if a batched call fails anyway, each of its rows is
sampled alone so only the faulty one is refused; actions that are not finite are never sent.
Error texts quote nothing of another request and no server path; a failure that is not the
request's fault is logged as a numbered incident and the client gets the number. Everything a
client controls is bounded (``ServeConfig``): message size, task length, requests waiting for
inference (beyond ``max_queue`` a "server busy" refusal; connections already answered go first, so
a flood of new connections waits behind robots in their closed loop), bytes in flight over all clients
(``max_inflight_mb``, each admitted message counted twice: it and its decoded arrays), the
write buffer, the handshake time and the connections (``admission.py``); a host that keeps
sending requests it is refused for is read again only after a back-off (``refusal_backoff_s``),
so its sends block rather than the server decoding them. A client that disconnects takes its
queued request with it, and a request whose client has left is not prepared. Browser origins are refused unless allowed
(``allow_origins``); the API key is compared in constant time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import http
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import websockets
from websockets.asyncio.server import Request, Response, ServerConnection, serve
from websockets.protocol import State

from embodied_jax.bundle import PolicyBundle, PreparedRow
from embodied_jax.errors import InputError
from embodied_jax.serve import wire
from embodied_jax.serve.admission import ByteBudget, ConnectionTable, RefusalBackoff
from embodied_jax.serve.config import ServeConfig, buckets
from embodied_jax.serve.requests import RequestReader, error_text

log = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(order=True)
class _Request:
    # Queue order: requests of connections already answered before (robots in their closed loop)
    # go before the first request of a new connection, then first come, first served.
    newcomer: bool
    seq: int
    row: PreparedRow = dataclasses.field(compare=False)
    key: jax.Array = dataclasses.field(compare=False)
    future: asyncio.Future = dataclasses.field(compare=False)  # -> _Answer
    received: float = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class _Refusal:
    text: str
    client_fault: bool  # the request's own fault (counts towards the host's back-off), not "server busy"


@dataclasses.dataclass(frozen=True)
class _Answer:
    actions: np.ndarray | None = None
    timing: dict[str, float] | None = None
    error: str | None = None


class PolicyServer:
    """Serves ``bundle`` with ``config``; ``run()`` until ``stop()`` (or SIGTERM in ``main``)."""

    def __init__(self, bundle: PolicyBundle, config: ServeConfig | None = None):
        self.bundle = bundle
        self.config = config = config or ServeConfig()
        self.buckets = buckets(config.max_batch)
        self.spec = bundle.observation_spec()
        self.metadata = {
            "observation": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.spec.items()},
            "action": {"shape": list(bundle.action_shape), "dtype": "float32"},
            "model": type(bundle.config.model).__name__,
            "step": int(bundle.step),
            "rtc": config.rtc,
        }
        self.reader = RequestReader(bundle, rtc=config.rtc, max_task_chars=config.max_task_chars, seed=config.seed)
        self._queue: asyncio.PriorityQueue[_Request] | None = None
        self._seq = 0
        # Inference and preparation each own one thread: a slow request's preparation never
        # holds up a batch being sampled, and neither runs on the event loop.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy")
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")
        self._stopped: asyncio.Event | None = None
        self.connections = ConnectionTable(config.max_connections)
        self.budget = ByteBudget(config.inflight_limit)
        self.backoff = RefusalBackoff(config.refusal_backoff_s)
        self.port: int | None = None
        self.served = 0
        self.refused = 0
        self.cancelled = 0
        self.incidents = 0
        self.loop_lag_ms: list[float] = []  # the event loop's lateness, sampled every 10 ms

    # ------------------------------------------------------------------ inference
    def example_observation(self) -> dict[str, Any]:
        """A well-formed observation of zeros (warm-up)."""
        example = {}
        for key, (shape, dtype) in self.spec.items():
            example[key] = "warm up" if dtype == "str" else np.zeros(shape, np.dtype(dtype))
        return example

    def warm_up(self) -> None:
        """Compile every bucket before accepting connections."""
        row = self.bundle.prepare_row(self.example_observation(), guided=self.config.rtc)
        for size in self.buckets:
            t0 = time.perf_counter()
            keys = jax.random.split(jax.random.key(0), size)
            self.bundle.sample_prepared([row] * size, keys, guided=self.config.rtc)
            log.info("bucket %d compiled in %.1f s", size, time.perf_counter() - t0)

    def _incident(self, what: str) -> str:
        """Log the current exception as a numbered incident; the text for the client."""
        self.incidents += 1
        log.exception("incident %d: %s", self.incidents, what)
        return f"{what} (incident {self.incidents}; the server log has the details)"

    def _sample(self, requests: list[_Request]) -> list[np.ndarray]:
        size = next(b for b in self.buckets if b >= len(requests))
        rows = [r.row for r in requests] + [requests[0].row] * (size - len(requests))
        keys = jax.numpy.stack([r.key for r in requests] + [requests[0].key] * (size - len(requests)))
        actions = self.bundle.sample_prepared(rows, keys, guided=self.config.rtc)
        return list(np.asarray(actions[: len(requests)], np.float32))

    def _infer(self, requests: list[_Request]) -> list[_Answer]:
        """Answers in request order; a failed batch is retried row by row, so only a faulty row fails."""
        t0 = time.perf_counter()
        try:
            outcomes: list[np.ndarray | str] = self._sample(requests)
        except Exception:
            log.exception("a batch of %d failed: sampling each request alone", len(requests))
            outcomes = []
            for r in requests:
                try:
                    outcomes.extend(self._sample([r]))
                except Exception:
                    outcomes.append(self._incident("inference failed for this request"))
        infer_ms = (time.perf_counter() - t0) * 1e3
        answers = []
        for outcome in outcomes:
            if isinstance(outcome, str):
                answers.append(_Answer(error=outcome))
            elif not np.isfinite(outcome).all():
                self.incidents += 1
                log.error("incident %d: non-finite actions not sent: %s", self.incidents, outcome.tolist())
                answers.append(
                    _Answer(error=f"inference produced non-finite actions (incident {self.incidents}); none were sent")
                )
            else:
                answers.append(_Answer(outcome, {"infer_ms": infer_ms, "batch_size": len(requests)}))
        return answers

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
            live = [r for r in batch if not r.future.done()]  # a client that left took its request with it
            self.cancelled += len(batch) - len(live)
            if not live:
                continue
            answers = await loop.run_in_executor(self._executor, self._infer, live)
            done = time.perf_counter()
            for r, answer in zip(live, answers, strict=True):
                if not r.future.done():
                    if answer.timing is not None:
                        answer = dataclasses.replace(
                            answer, timing={**answer.timing, "queue_ms": (done - r.received) * 1e3}
                        )
                    r.future.set_result(answer)

    # ------------------------------------------------------------------ one request
    def _prepare_or_refuse(
        self, message: bytes, connection: ServerConnection
    ) -> tuple[PreparedRow, jax.Array] | _Refusal | None:
        """``RequestReader.read``'s result, a refusal, or None (the client left while the request
        waited). Refusals stay in this thread as text: an exception carried back would keep the
        request's decoded arrays alive in its traceback until the garbage collector found the cycle."""
        if connection.protocol.state is not State.OPEN:
            return None
        try:
            return self.reader.read(message)
        except InputError as e:
            return _Refusal(str(e), client_fault=True)
        except Exception:
            return _Refusal(self._incident("this request could not be prepared"), client_fault=False)

    async def _answer(self, connection: ServerConnection, message: bytes | str) -> bytes | _Refusal | None:
        """The reply to one message: packed actions, a refusal, or None (the client left)."""
        if isinstance(message, str):
            return _Refusal("expected a binary msgpack-numpy message, got a text frame", client_fault=True)
        limit = self.config.message_limit
        if len(message) > limit:
            return _Refusal(
                f"message of {len(message)} bytes exceeds the {limit}-byte limit (--max-message-mb)", client_fault=True
            )
        if connection.protocol.state is not State.OPEN:
            self.cancelled += 1  # the client sent and left (a close frame followed its request)
            return None
        cost = 2 * len(message)
        if not self.budget.try_acquire(cost):
            busy = "server busy: too many request bytes in flight (--max-inflight-mb); retry later"
            return _Refusal(busy, client_fault=False)
        loop = asyncio.get_running_loop()
        try:
            prepared = await loop.run_in_executor(self._prepare_pool, self._prepare_or_refuse, message, connection)
            del message
            if prepared is None:
                self.cancelled += 1
                return None
            if isinstance(prepared, _Refusal):
                return prepared
            row, key = prepared
            future = loop.create_future()
            try:
                self._seq += 1
                newcomer = self.connections.answered(connection) == 0
                self._queue.put_nowait(_Request(newcomer, self._seq, row, key, future, time.perf_counter()))
            except asyncio.QueueFull:
                busy = f"server busy: {self.config.max_queue} requests wait for inference (--max-queue); retry later"
                return _Refusal(busy, client_fault=False)
            closed = asyncio.ensure_future(connection.wait_closed())
            try:
                await asyncio.wait({future, closed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                closed.cancel()
            if not future.done():
                future.cancel()  # the client left: the batcher skips its request
                return None
            answer: _Answer = future.result()
            if answer.error is not None:
                return _Refusal(answer.error, client_fault=False)
            return wire.packb({"actions": answer.actions, "server_timing": answer.timing})
        finally:
            self.budget.release(cost)

    # ------------------------------------------------------------------ connections
    async def _handler(self, connection: ServerConnection) -> None:
        try:
            await self._send(connection, wire.packb(self.metadata))
            back_off = True  # a new connection of a host refused again and again waits before its first request
            while True:
                if back_off:
                    await self._back_off(connection)
                message = await connection.recv()
                self.connections.request_started(connection)
                answered = False
                try:
                    reply = await self._answer(connection, message)
                    del message  # an idle connection holds no message
                    if reply is None:
                        return
                    answered = not isinstance(reply, _Refusal)
                    back_off = not answered and reply.client_fault
                    self.served += answered
                    self.refused += not answered
                    if answered:
                        await self._send(connection, reply)
                    else:
                        if back_off:
                            self.backoff.refused(connection.peer_host)
                        await self._send(connection, error_text(reply.text))
                finally:
                    self.connections.request_finished(connection, answered=answered)
        except websockets.ConnectionClosed:
            pass  # the client left; its pending answer (if any) is dropped

    async def _back_off(self, connection: ServerConnection) -> None:
        """Wait out the host's refusal back-off (after this connection's own refusal, or before a new
        connection's first request) with the connection's reading paused: what it sends meanwhile
        stays in its socket, and its sends block once that is full. Connections that are answered
        never wait, whatever else their host sends."""
        delay = self.backoff.delay(connection.peer_host)
        if delay <= 0:
            return
        transport = connection.transport
        transport.pause_reading()
        try:
            await asyncio.sleep(delay)
        finally:
            # websockets pauses reading too when its queue of received messages is full; leave that to it
            if not transport.is_closing() and not connection.recv_messages.paused:
                transport.resume_reading()

    async def _send(self, connection: ServerConnection, reply: bytes | str) -> None:
        """Send, or drop a client that has not read its answers for ``send_timeout_s``."""
        try:
            async with asyncio.timeout(self.config.send_timeout_s):
                await connection.send(reply)
        except TimeoutError:
            log.warning("closing a connection that has not read its answers for %.0f s", self.config.send_timeout_s)
            connection.transport.abort()
            raise websockets.ConnectionClosed(None, None) from None

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        if self.config.api_key is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Api-Key {self.config.api_key}".encode()):
                return connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")
        return None

    def _evict(self, connection: ServerConnection) -> None:
        if connection.protocol.state is State.OPEN:
            reason = "server at its connection cap: closed the connection silent longest"

            async def close() -> None:
                try:
                    async with asyncio.timeout(1.0):
                        await connection.close(1013, reason)
                except TimeoutError:
                    connection.transport.abort()

            asyncio.ensure_future(close())
        else:
            connection.transport.abort()

    def _connection_class(self) -> type[ServerConnection]:
        table, evict, backoff = self.connections, self._evict, self.backoff

        class TrackedConnection(ServerConnection):
            """Counted from TCP accept to close (``admission.ConnectionTable``); knows its peer's host."""

            peer_host: str | None = None

            def connection_made(self, transport) -> None:
                super().connection_made(transport)
                peer = transport.get_extra_info("peername")
                self.peer_host = peer[0] if isinstance(peer, tuple) and peer else None
                victim = table.opened(self)
                if victim is not None:
                    evict(victim)

            def connection_lost(self, exc) -> None:
                table.closed(self)
                super().connection_lost(exc)
                # A protocol error (a message over max_size) leaves the exception in the protocol and the
                # protocol in the exception's traceback: a cycle that would keep the bytes read so far
                # (tens of MiB) until the garbage collector ran. Drop the bytes and the traceback now.
                protocol = self.protocol
                if getattr(protocol, "parser_exc", None) is not None:
                    if isinstance(protocol.parser_exc, websockets.PayloadTooBig):
                        backoff.refused(self.peer_host)  # closed with 1009: a refusal of the request's own making
                    protocol.parser_exc.__traceback__ = None
                buffer = getattr(getattr(protocol, "reader", None), "buffer", None)
                if isinstance(buffer, bytearray):
                    buffer.clear()

        return TrackedConnection

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(0.01)
            self.loop_lag_ms.append(max(0.0, (loop.time() - start - 0.01) * 1e3))
            if len(self.loop_lag_ms) > 100_000:
                del self.loop_lag_ms[:50_000]

    async def run(self, ready: Callable[[PolicyServer], None] | None = None) -> None:
        """Serve until ``stop()``; ``ready(self)`` once the port is bound (``self.port``)."""
        config = self.config
        self._queue = asyncio.PriorityQueue(maxsize=config.max_queue)
        self._stopped = asyncio.Event()
        if config.host not in LOCAL_HOSTS and config.api_key is None:
            log.warning(
                "serving on %s without an API key: any host that reaches it can query the policy "
                "(--api-key KEY or EMBODIED_JAX_API_KEY)",
                config.host,
            )
        # A message a little over the limit is read and refused with a named error; a larger one
        # is refused by websockets (close 1009) before it is buffered whole.
        async with serve(
            self._handler,
            config.host,
            config.port,
            compression=None,
            max_size=config.message_limit + 2**16,
            max_queue=2,
            write_limit=config.write_limit_kb * 1024,
            open_timeout=config.handshake_timeout_s,
            origins=[None, *config.allow_origins],  # None: no Origin header (robots, not browsers)
            process_request=self._process_request,
            create_connection=self._connection_class(),
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            tasks = [asyncio.create_task(self._batcher()), asyncio.create_task(self._watch_loop())]
            if ready is not None:
                ready(self)
            await self._stopped.wait()
            for task in tasks:
                task.cancel()
        self._executor.shutdown(wait=True)
        self._prepare_pool.shutdown(wait=True)

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()
