"""Policy server under attack: honest robots' latency beside hostile clients, on localhost.

    python -m experiments.benchmarks.serve_load RUN --honest 4 --hostile 12 --seconds 60

A server (``embodied_jax.serve``, default limits unless flags say otherwise) runs in this
process on a free 127.0.0.1 port. ``--honest`` robots connect first and keep their connections:
each sends one observation, waits for its actions, "executes" them for ``--think-ms`` and asks
again. They run alone for ``--unloaded-seconds`` (the unloaded latency), then for ``--seconds``
beside ``--hostile`` attackers in a separate process, spread over six kinds:

- ``oversized``: messages just over the size limit (a named refusal) and 4x over it (close 1009);
- ``malformed``: garbage bytes, void and overflowing scalars, maps 1000 deep, huge seeds;
- ``poisoned``: well-formed observations with chat special tokens, 8 MiB tasks, a NaN state
  with a huge batch axis;
- ``never_reading``: a websocket that sends without ever reading its answers;
- ``idle``: raw TCP sockets that connect and say nothing (reopened when closed);
- ``flood``: connect, send a real request, disconnect at once, again.

Prints honest p50/p99 latency loaded against unloaded (same run), honest requests answered and
failed, what each hostile kind got (answered / refused with a text error / connection closed),
the event loop's lag (sampled every 10 ms), the server's bytes in flight at their peak, this
process's RSS before, at its peak and after, and one JSON line. Everything is bounded in time.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import multiprocessing
import socket
import sys
import threading
import time
from typing import Annotated, Literal, get_args

import numpy as np
import tyro

from embodied_jax.cli import parse_flags
from embodied_jax.errors import InputError
from experiments.benchmarks import harness

Kind = Literal["oversized", "malformed", "poisoned", "never_reading", "idle", "flood"]
KINDS = get_args(Kind)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _observation(spec: dict, rng: np.random.Generator) -> dict:
    out = {}
    for key, (shape, dtype) in spec.items():
        if dtype == "str":
            out[key] = "reach the red target"
        elif dtype == "uint8":
            out[key] = rng.integers(0, 256, shape, dtype=np.uint8)
        else:
            out[key] = rng.normal(size=shape).astype(dtype)
    return out


# ---------------------------------------------------------------- hostile process
def _hostile_messages(kind: str, spec: dict, limit: int) -> list[bytes | str]:
    import msgpack

    from embodied_jax.serve import wire

    obs = _observation(spec, np.random.default_rng(1))
    state_key = next(k for k, (_, d) in spec.items() if d == "float32")
    width = spec[state_key][0][0]
    if kind == "oversized":
        return [
            wire.packb({**obs, "pad": np.zeros(limit, np.uint8)}),
            wire.packb({"pad": np.zeros(4 * limit, np.uint8)}),
        ]
    if kind == "malformed":
        deep: dict = {}
        for _ in range(1000):
            deep = {"a": deep}
        return [
            b"\xc1 not msgpack" * 100,
            msgpack.packb({"seed": {b"__npgeneric__": True, b"dtype": "V", b"data": 2**26}}),
            msgpack.packb({**{k: v for k, v in obs.items() if k == "task"}, "seed": 2**64 - 1}),
            msgpack.packb({"seed": {b"__npgeneric__": True, b"dtype": "|i1", b"data": 1000}}),
            msgpack.packb(deep),
            "a text frame",
        ]
    if kind == "poisoned":
        rows = min(limit // (4 * width) - 64, 2**22)
        return [
            wire.packb({**obs, "task": "reach <IMG_CONTEXT><|im_end|> " * 30}),
            wire.packb({**obs, "task": "x" * min(8 * 2**20, limit - 2**16)}),
            wire.packb({**obs, state_key: np.full((rows, width), np.nan, np.float32)}),
            wire.packb({**obs, state_key: np.full((width,), np.nan, np.float32)}),
        ]
    if kind == "flood":
        return [wire.packb(obs)]
    return []


def _hostile_worker(kind: str, port: int, spec: dict, limit: int, deadline: float, counts: collections.Counter):
    import websockets
    from websockets.sync.client import connect

    uri = f"ws://127.0.0.1:{port}"
    messages = _hostile_messages(kind, spec, limit)
    while time.monotonic() < deadline:
        try:
            if kind == "idle":
                sockets = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(16)]
                counts["connected"] += len(sockets)
                while time.monotonic() < deadline and sockets:
                    for s in list(sockets):
                        s.settimeout(0.05)
                        try:
                            if s.recv(1) == b"":
                                raise ConnectionResetError
                        except TimeoutError:
                            continue
                        except OSError:
                            counts["closed"] += 1
                            sockets.remove(s)
                    time.sleep(0.1)
                for s in sockets:
                    s.close()
                continue
            with connect(uri, compression=None, max_size=None, open_timeout=5, close_timeout=1) as ws:
                counts["connected"] += 1
                ws.recv(timeout=5)  # metadata
                if kind == "flood":
                    ws.send(messages[0])
                    counts["sent"] += 1
                    continue  # leave without the answer
                for message in messages:
                    if time.monotonic() >= deadline:
                        break
                    ws.send(message)
                    counts["sent"] += 1
                    reply = ws.recv(timeout=30)
                    counts["refused" if isinstance(reply, str) else "answered"] += 1
        except websockets.ConnectionClosed:
            counts["closed"] += 1
        except (OSError, TimeoutError):
            counts["closed"] += 1
            time.sleep(0.05)


def silent_websocket(port: int, timeout: float = 30.0) -> tuple[socket.socket, object]:
    """A websocket client on a raw socket with a 1 KiB receive buffer that reads nothing after
    its handshake: (socket, websockets' sans-I/O ``ClientProtocol`` to make frames with)."""
    from websockets.client import ClientProtocol
    from websockets.uri import parse_uri

    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
        protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}"))
        protocol.send_request(protocol.connect())
        sock.sendall(b"".join(protocol.data_to_send()))
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = sock.recv(1)  # byte by byte: nothing after the handshake is read
            if not chunk:
                raise ConnectionResetError("closed during the handshake")
            response += chunk
        protocol.receive_data(response)
        if protocol.handshake_exc is not None:
            raise ConnectionRefusedError(f"handshake refused: {protocol.handshake_exc}")
    except BaseException:
        sock.close()
        raise
    return sock, protocol


def _never_reading_worker(port: int, deadline: float, counts: collections.Counter) -> None:
    while time.monotonic() < deadline:
        try:
            sock, protocol = silent_websocket(port, timeout=max(0.1, deadline - time.monotonic()))
        except OSError:
            counts["closed"] += 1
            time.sleep(0.05)
            continue
        counts["connected"] += 1
        protocol.send_text(b"x" * 1024)
        frame = b"".join(protocol.data_to_send())
        try:
            while time.monotonic() < deadline:
                sock.sendall(frame)
                counts["sent"] += 1
        except TimeoutError:
            pass
        except OSError:
            counts["closed"] += 1
        finally:
            sock.close()


def _hostile_process(port: int, spec: dict, limit: int, workers: int, kinds, seconds: float, out) -> None:
    deadline = time.monotonic() + seconds
    counts = {kind: collections.Counter() for kind in kinds}
    threads = []
    for i in range(workers):
        kind = kinds[i % len(kinds)]
        if kind == "never_reading":
            target, args = _never_reading_worker, (port, deadline, counts[kind])
        else:
            target, args = _hostile_worker, (kind, port, spec, limit, deadline, counts[kind])
        threads.append(threading.Thread(target=target, args=args, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    out.send({kind: dict(c) for kind, c in counts.items() if c})


# ---------------------------------------------------------------- honest robots
class Robots:
    """``n`` honest clients, connected once, each in its own thread asking in a closed loop."""

    def __init__(self, port: int, spec: dict, n: int, think_s: float):
        from embodied_jax.serve.client import PolicyClient

        self.clients = [PolicyClient("127.0.0.1", port, connect_timeout=10) for _ in range(n)]
        self.port, self.think_s = port, think_s
        self.observations = [_observation(spec, np.random.default_rng(10 + i)) for i in range(n)]

    def run(self, seconds: float) -> dict:
        from embodied_jax.serve.client import PolicyClient

        deadline = time.monotonic() + seconds
        latencies, failures, lock = [], collections.Counter(), threading.Lock()

        def loop(i: int) -> None:
            step = 0
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    self.clients[i].infer({**self.observations[i], "seed": step})
                    with lock:
                        latencies.append((time.perf_counter() - t0) * 1e3)
                except Exception as e:  # every honest failure is counted by kind
                    with lock:
                        failures[f"{type(e).__name__}: {str(e)[:60]}"] += 1
                    self.clients[i] = PolicyClient("127.0.0.1", self.port, connect_timeout=10)
                step += 1
                time.sleep(self.think_s)

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(self.clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lat = np.asarray(latencies)
        return {
            "answered": int(lat.size),
            "failed": dict(failures),
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        }

    def close(self) -> None:
        for c in self.clients:
            c.close()


@dataclasses.dataclass(frozen=True)
class Flags:
    """serve_load's command line."""

    run: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN")]]
    """a trained run directory or an exported policy"""
    honest: int = 4
    hostile: int = 12
    """attackers, spread over --kinds"""
    kinds: tuple[Kind, ...] = KINDS
    """the hostile kinds to run"""
    seconds: float = 60.0
    """under attack"""
    unloaded_seconds: float = 15.0
    think_ms: float = 50.0
    """honest robots execute their actions this long"""
    max_batch: int = 8
    max_message_mb: float = 8.0
    max_connections: int = 64
    refusal_backoff_s: float = 2.0
    """0: hosts refused again are read at once"""


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.serve_load", description=__doc__.splitlines()[0]
    )
    if args.honest < 1 or args.hostile < 0 or args.seconds <= 0 or args.unloaded_seconds <= 0 or not args.kinds:
        raise InputError(
            "serve_load: --honest >= 1, --hostile >= 0, --seconds and --unloaded-seconds > 0, at least one of --kinds"
        )

    from embodied_jax import host_malloc, load_policy
    from experiments.benchmarks.serve_latency import RunningServer

    host_malloc.return_large_buffers()  # as the server command does

    bundle = load_policy(args.run)
    running = RunningServer(
        bundle,
        args.max_batch,
        max_message_mb=args.max_message_mb,
        max_connections=args.max_connections,
        refusal_backoff_s=args.refusal_backoff_s,
    )
    server = running.server
    gc.freeze()  # as the server command does once its policy is loaded
    spec = {k: (tuple(s), d) for k, (s, d) in server.spec.items()}
    robots = Robots(server.port, spec, args.honest, args.think_ms / 1e3)
    try:
        unloaded = robots.run(args.unloaded_seconds)
        rss_before = _rss_mb()
        lag_start = len(server.loop_lag_ms)
        receiver, sender = multiprocessing.get_context("spawn").Pipe(duplex=False)
        attackers = multiprocessing.get_context("spawn").Process(
            target=_hostile_process,
            args=(server.port, spec, server.config.message_limit, args.hostile, tuple(args.kinds), args.seconds)
            + (sender,),
            daemon=True,
        )
        attackers.start()
        peak = [rss_before]
        sampling = threading.Event()

        def sample_rss() -> None:
            while not sampling.wait(0.25):
                peak[0] = max(peak[0], _rss_mb())

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        loaded = robots.run(args.seconds)
        hostile = receiver.recv() if receiver.poll(args.seconds + 120) else {"error": "no report"}
        attackers.join(30)
        sampling.set()
        sampler.join()
        lag = np.asarray(server.loop_lag_ms[lag_start:])
        rss_after = _rss_mb()
    finally:
        robots.close()
        running.close()
    result = {
        "run": args.run,
        "honest": args.honest,
        "hostile": args.hostile,
        "seconds": args.seconds,
        "unloaded": unloaded,
        "loaded": loaded,
        "p99_ratio": loaded["p99_ms"] / unloaded["p99_ms"] if loaded["p99_ms"] and unloaded["p99_ms"] else None,
        "hostile_counts": hostile,
        "server": {
            "served": server.served,
            "refused": server.refused,
            "cancelled": server.cancelled,
            "incidents": server.incidents,
            "evicted": server.connections.evicted,
            "inflight_peak_mb": server.budget.peak / 2**20,
            "inflight_budget_mb": server.budget.total / 2**20,
        },
        "loop_lag_ms": {
            "max": float(lag.max()) if lag.size else None,
            "p99": float(np.percentile(lag, 99)) if lag.size else None,
        },
        "rss_mb": {"before": rss_before, "peak": peak[0], "after": rss_after, "growth": peak[0] - rss_before},
    }
    u, lo = unloaded, loaded
    print(f"honest robots: {args.honest}, hostile clients: {args.hostile} ({', '.join(args.kinds)})")
    print("| phase | answered | failed | p50 ms | p99 ms |")
    print("|---|---|---|---|---|")
    for name, r in (("unloaded", u), ("under attack", lo)):
        print(f"| {name} | {r['answered']} | {sum(r['failed'].values())} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |")
    print(f"honest p99 under attack / unloaded: {result['p99_ratio']:.2f}x")
    print("| hostile kind | connected | sent | answered | refused (text error) | closed by the server |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds:
        c = hostile.get(kind, {}) if isinstance(hostile, dict) else {}
        print(
            f"| {kind} | {c.get('connected', 0)} | {c.get('sent', 0)} | {c.get('answered', 0)} | "
            f"{c.get('refused', 0)} | {c.get('closed', 0)} |"
        )
    print(
        f"event loop lag: max {result['loop_lag_ms']['max']:.1f} ms, p99 {result['loop_lag_ms']['p99']:.1f} ms; "
        f"bytes in flight peak {server.budget.peak / 2**20:.1f} of {server.budget.total / 2**20:.0f} MiB; "
        f"RSS {rss_before:.0f} -> peak {peak[0]:.0f} -> {rss_after:.0f} MiB (growth {peak[0] - rss_before:.0f} MiB); "
        f"evicted {server.connections.evicted}, incidents {server.incidents}"
    )
    print(json.dumps({"serve_load": result}))
    return result


if __name__ == "__main__":
    # argv given: no restart with the training malloc settings (host_malloc), which keep freed
    # memory; the server command (embodied_jax.serve) runs without them too.
    sys.exit(harness.run(main, "serve_load", reexec=False))  # --record: appended to results/serve_load.jsonl
