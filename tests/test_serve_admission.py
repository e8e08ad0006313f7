"""The policy server's admission against unkind clients: clients that leave, a full queue, robots
before newcomers, bytes in flight, never-reading and idle sockets, the connection cap, the refusal
back-off, browser origins and the API key (docs/reliability.md's serving table, second half)."""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
import time

import pytest
from websockets.sync.client import connect

from embodied_jax.serve import wire
from embodied_jax.serve.client import ServerError
from experiments.benchmarks.serve_load import silent_websocket
from tests.hostile_server import (
    MARK,
    connect_client,
    demo_observation,
    infer_once,
    marked,
    running,
    warm_bundle,
)


@pytest.fixture(scope="module")
def bundle(demo_run):
    return warm_bundle(demo_run)


@pytest.fixture(scope="module")
def observation(demo_run):
    return demo_observation(demo_run)


@contextlib.contextmanager
def _slow_inference(bundle, monkeypatch, seconds):
    """The first batch sampled takes ``seconds`` longer; yields the row counts of every call."""
    real = bundle.sample_prepared
    calls = []

    def slow(rows, keys, *, guided=False):
        calls.append(len(rows))
        if len(calls) == 1:
            time.sleep(seconds)
        return real(rows, keys, guided=guided)

    monkeypatch.setattr(bundle, "sample_prepared", slow)
    yield calls


def test_clients_that_leave_take_their_queued_work_with_them(bundle, observation, monkeypatch):
    with _slow_inference(bundle, monkeypatch, 1.5) as calls, running(bundle, batch_timeout_ms=20.0) as server:
        first = threading.Thread(target=infer_once, args=(server, {**observation, "seed": 0}))
        first.start()
        time.sleep(0.5)  # the first request is being sampled
        for i in range(8):
            leaver = connect_client(server)
            leaver._connection.send(wire.packb({**observation, "seed": i}))
            leaver.close()
        first.join(60)
        assert infer_once(server, {**observation, "seed": 9})["actions"].shape == bundle.action_shape
        deadline = time.monotonic() + 5
        while server.cancelled < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert server.cancelled == 8 and sum(calls) == 2  # only the two requests whose clients stayed were sampled


def test_a_full_queue_answers_server_busy_at_once(bundle, observation, monkeypatch):
    results = []  # in the order they complete
    with _slow_inference(bundle, monkeypatch, 2.0), running(bundle, batch_timeout_ms=20.0, max_queue=1) as server:
        threads = []
        for seed in range(3):
            message = {**observation, "seed": seed}
            thread = threading.Thread(target=lambda m=message: results.append(_catch(lambda: infer_once(server, m))))
            thread.start()
            threads.append(thread)
            time.sleep(0.5)  # 0: being sampled; 1: waits in the queue; 2: refused
        for thread in threads:
            thread.join(60)
    assert isinstance(results[0], ServerError), results  # refused at once, before the others are answered
    assert "server busy" in str(results[0]) and "--max-queue" in str(results[0])
    assert all(isinstance(r, dict) for r in results[1:])


def test_robots_already_answered_go_before_new_connections(bundle, observation, monkeypatch):
    order = []
    real = bundle.sample_prepared

    def recording(rows, keys, *, guided=False):
        order.extend("robot" if r.state[0] == MARK else "newcomer" for r in rows)
        if len(order) == 2:  # the robot's first request, then the blocker: hold the queue
            time.sleep(1.5)
        return real(rows, keys, guided=guided)

    monkeypatch.setattr(bundle, "sample_prepared", recording)
    with running(bundle, max_batch=1, batch_timeout_ms=1.0) as server, connect_client(server) as robot:
        robot.infer(marked(observation))  # answered once: from now on a known robot
        blocker = threading.Thread(target=infer_once, args=(server, observation))
        blocker.start()
        time.sleep(0.5)  # the blocker is being sampled
        newcomer = threading.Thread(target=infer_once, args=(server, observation))
        newcomer.start()
        time.sleep(0.3)  # the newcomer waits in the queue first ...
        robot.infer(marked(observation))  # ... yet the robot is sampled before it
        for thread in (blocker, newcomer):
            thread.join(60)
    assert order == ["robot", "newcomer", "robot", "newcomer"]


def _catch(call):
    try:
        return call()
    except ServerError as e:
        return e


def test_bytes_in_flight_are_bounded_over_all_clients(bundle, observation, monkeypatch):
    size = len(wire.packb(observation))
    limit_mb = 1.2 * size / 2**20
    with (
        _slow_inference(bundle, monkeypatch, 1.5),
        running(bundle, batch_timeout_ms=20.0, max_message_mb=limit_mb, max_inflight_mb=2 * limit_mb) as server,
    ):
        first = threading.Thread(target=infer_once, args=(server, {**observation, "seed": 0}))
        first.start()
        time.sleep(0.5)
        with pytest.raises(ServerError, match="server busy: too many request bytes in flight"):
            infer_once(server, {**observation, "seed": 1})
        first.join(60)
        assert server.budget.peak <= server.budget.total
        assert infer_once(server, {**observation, "seed": 2})["actions"].shape == bundle.action_shape


def test_a_client_that_never_reads_is_disconnected(bundle, observation):
    with running(bundle, send_timeout_s=1.0, write_limit_kb=1) as server:
        sock, protocol = silent_websocket(server.port)
        frame = None
        dropped = False
        try:
            for _ in range(1_000_000):  # each text frame is answered with an error it never reads
                if frame is None:
                    protocol.send_text(b"x" * 64)
                    frame = b"".join(protocol.data_to_send())
                sock.sendall(frame)
        except OSError:  # reset by the server (a blocked send times out too, if it were never reset)
            dropped = True
        assert dropped
        assert server.refused > 0
        assert infer_once(server, observation)["actions"].shape == bundle.action_shape


def test_a_host_refused_again_and_again_is_read_slowly_and_its_answered_robots_are_not(bundle, observation):
    with running(bundle, refusal_backoff_s=1.0) as server, connect_client(server) as robot:
        assert robot.infer({**observation, "seed": 0})["actions"].shape == bundle.action_shape
        with connect(f"ws://127.0.0.1:{server.port}", compression=None, close_timeout=0.1) as attacker:
            attacker.recv(timeout=5)  # metadata
            for _ in range(40):
                attacker.send("not a binary message")  # refused, the request's own fault, never read back
            time.sleep(1.0)
            # Back-off 0, 0, 50, 100, 200, 400, 800 ms: at most 6 of the 40 are read within the second.
            assert 2 <= server.refused <= 6
            assert server.backoff.delay("127.0.0.1") > 0
            # A robot of the same host that is answered never waits: its requests go on at once.
            for seed in range(3):
                assert robot.infer({**observation, "seed": seed})["actions"].shape == bundle.action_shape
            assert server.refused <= 8  # and the attacker is still read slowly


def test_refusal_backoff_doubles_is_capped_and_forgotten(monkeypatch):
    from embodied_jax.serve import admission

    now = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    backoff = admission.RefusalBackoff(max_s=0.3, base_s=0.05, forget_s=10.0, max_hosts=2)
    delays = []
    for _ in range(6):
        delays.append(backoff.delay("a"))
        backoff.refused("a")
    assert delays == [0.0, 0.0, 0.05, 0.1, 0.2, 0.3]  # the first refusal costs nothing
    assert backoff.delay("b") == 0.0  # another host is not affected
    now[0] += 10.0
    assert backoff.delay("a") == 0.0  # forgotten after forget_s without a refusal
    for host in ("a", "a", "b", "c"):  # at most max_hosts remembered: the one refused least recently goes
        backoff.refused(host)
    assert backoff.delay("a") == 0.0 and backoff._strikes("c", now[0]) == 1
    assert admission.RefusalBackoff(max_s=0.0).delay("a") == 0.0
    with pytest.raises(ValueError, match="max_s"):
        admission.RefusalBackoff(max_s=-1.0)


def _closed(sock, timeout):
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_sockets_are_closed_after_the_handshake_time(bundle):
    with running(bundle, handshake_timeout_s=0.5) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        assert _closed(sock, 5)


def test_at_the_connection_cap_the_most_silent_connection_makes_room(bundle, observation):
    with running(bundle, max_connections=3, handshake_timeout_s=60.0) as server, connect_client(server) as robot:
        robot.infer(observation)
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]  # at the cap, with room
        time.sleep(0.2)
        assert not any(_closed(s, 0.2) for s in idle) and robot.infer(observation)["actions"].size
        newcomer = socket.create_connection(("127.0.0.1", server.port))  # over the cap: the most silent goes
        assert _closed(idle[0], 5) and not _closed(idle[1], 0.2) and not _closed(newcomer, 0.2)
        assert robot.infer(observation)["actions"].size and server.connections.evicted == 1
        for s in (*idle, newcomer):
            s.close()


# ---------------------------------------------------------------- the handshake
def test_browser_origins_are_refused_unless_allowed(bundle):
    from websockets.exceptions import InvalidStatus

    with running(bundle) as server:
        with pytest.raises(InvalidStatus, match="403"):
            connect(f"ws://127.0.0.1:{server.port}", origin="http://evil.example")
    with running(bundle, allow_origins=("http://lab.example",)) as server:
        connect(f"ws://127.0.0.1:{server.port}", origin="http://lab.example").close()
        with pytest.raises(InvalidStatus, match="403"):
            connect(f"ws://127.0.0.1:{server.port}", origin="http://evil.example")


def test_the_api_key_is_compared_in_constant_time(bundle, monkeypatch):
    from websockets.exceptions import InvalidStatus

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(len(a)) or real(a, b))
    with running(bundle, api_key="k3y") as server:
        with pytest.raises(InvalidStatus, match="401"):
            connect_client(server, api_key="wrong")
        connect_client(server, api_key="k3y").close()
    assert len(compared) == 2
