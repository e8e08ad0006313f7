"""The policy server against unkind clients: every fault of docs/reliability.md's serving table.

Each test starts a server in this process (its own event loop in a thread) on the shared demo
run's policy, with limits small enough to reach, and talks to it with real websocket clients
or raw sockets. Faults that need the policy to misbehave (a transform or a batched call that
raises, actions that are not finite) are injected by patching the bundle.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import threading
import time

import numpy as np
import pytest
import websockets
from websockets.sync.client import connect

from embodied_jax.bundle import NormStatsError, PolicyBundle
from embodied_jax.serve import wire
from embodied_jax.serve.client import PolicyClient, ServerError
from embodied_jax.serve.config import ServeConfig
from embodied_jax.serve.requests import MAX_ERROR_BYTES
from embodied_jax.serve.server import PolicyServer
from experiments.benchmarks.serve_load import silent_websocket

SECRET_PATH = "/srv/models/secret/tokenizer.model"
MARK = 123.0  # a state value that makes the patched policy misbehave


@pytest.fixture(scope="module")
def bundle(demo_run):
    from embodied_jax import load_policy

    policy = load_policy(demo_run)
    PolicyServer(policy, ServeConfig(max_batch=2)).warm_up()  # buckets 1 and 2, shared by every server here
    return policy


@pytest.fixture(scope="module")
def observation(bundle, demo_run):
    from embodied_jax.data.lerobot import LeRobotDataset

    frame = LeRobotDataset(demo_run / "dataset").frame(0, 0)
    raw = {k: np.asarray(v) for k, v in frame.items() if k.startswith("observation.")}
    raw["task"] = frame["task"]
    return raw


@contextlib.contextmanager
def running(bundle, **overrides):
    """A server on a free port in a thread of this process, stopped on exit."""
    # No refusal back-off unless a test asks for it: most tests send one bad request after another.
    settings = dict(
        port=0, max_batch=2, batch_timeout_ms=200.0, max_message_mb=0.25, max_inflight_mb=4.0, refusal_backoff_s=0.0
    )
    server = PolicyServer(bundle, ServeConfig(**{**settings, **overrides}))
    started = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.run(lambda s: started.set())), daemon=True)
    thread.start()
    assert started.wait(60), "the server did not start"
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(60)
        loop.close()


def _client(server, **kw) -> PolicyClient:
    return PolicyClient("127.0.0.1", server.port, connect_timeout=5, **kw)


def _marked(observation):
    state = np.array(observation["observation.state"], np.float32)
    state[0] = MARK
    return {**observation, "observation.state": state}


def _concurrently(*calls):
    """Run each call in its own thread at once; their results (or exceptions) in order."""
    results = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as e:  # the test inspects it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _infer_once(server, message):
    with _client(server) as client:
        return client.infer(message)


def _assert_text_error(reply, *fields):
    assert isinstance(reply, str) and reply.startswith("error: "), reply
    assert len(reply.encode()) <= MAX_ERROR_BYTES
    for field in fields:
        assert field in reply, reply


# ---------------------------------------------------------------- one request's fault stays its own
def test_a_request_whose_preparation_fails_fails_alone_and_leaks_nothing(bundle, observation, monkeypatch):
    real = bundle.transform

    def transform(sample):
        if "POISON" in sample["task"]:
            raise ValueError(f"{SECRET_PATH}: cannot tokenise {sample['task']!r}")
        return real(sample)

    monkeypatch.setattr(bundle, "transform", transform)
    honest_task = "honest robot's private instruction"
    with running(bundle) as server:
        poisoned, honest = _concurrently(
            lambda: _infer_once(server, {**observation, "task": "POISON", "seed": 1}),
            lambda: _infer_once(server, {**observation, "task": honest_task, "seed": 2}),
        )
    assert isinstance(poisoned, ServerError)
    text = str(poisoned)
    assert "could not be prepared (incident 1" in text
    assert SECRET_PATH not in text and honest_task not in text
    assert honest["actions"].shape == bundle.action_shape


def test_a_failing_batch_is_retried_row_by_row(bundle, observation, monkeypatch):
    real = bundle.sample_prepared
    calls = []

    def flaky(rows, keys, *, guided=False):
        calls.append(len(rows))
        if any(r.state[0] == MARK for r in rows):
            raise RuntimeError(f"INTERNAL: device lost while reading {SECRET_PATH}")
        return real(rows, keys, guided=guided)

    monkeypatch.setattr(bundle, "sample_prepared", flaky)
    with running(bundle, batch_timeout_ms=500.0) as server:
        alone = _infer_once(server, {**observation, "seed": 4})["actions"]
        poisoned, honest = _concurrently(
            lambda: _infer_once(server, {**_marked(observation), "seed": 3}),
            lambda: _infer_once(server, {**observation, "seed": 4}),
        )
    assert calls[1:] == [2, 1, 1]  # the batch of both, then each alone
    assert isinstance(poisoned, ServerError) and "inference failed for this request (incident" in str(poisoned)
    assert SECRET_PATH not in str(poisoned)
    np.testing.assert_allclose(honest["actions"], alone, rtol=1e-5, atol=1e-5)  # its own key: the same actions


def test_non_finite_actions_are_never_sent(bundle, observation, monkeypatch):
    real = bundle.sample_prepared

    def nan_for_marked(rows, keys, *, guided=False):
        actions = real(rows, keys, guided=guided)
        actions[[r.state[0] == MARK for r in rows]] = np.nan
        return actions

    monkeypatch.setattr(bundle, "sample_prepared", nan_for_marked)
    with running(bundle) as server, _client(server) as client:
        with pytest.raises(ServerError, match="non-finite actions"):
            client.infer(_marked(observation))
        assert np.isfinite(client.infer(observation)["actions"]).all()
        assert server.incidents == 1


def test_statistics_with_nan_are_refused_when_the_policy_loads(bundle):
    stats = {k: v.to_json() for k, v in bundle.stats.items()}
    key = bundle.inputs.action_key
    stats[key]["std"][0] = float("nan")
    with pytest.raises(NormStatsError, match=f"norm_stats\\['{key}'\\]: std"):
        PolicyBundle(bundle.config, bundle.model, stats, step=bundle.step)


def test_a_task_with_a_gr00t_special_token_is_the_task_s_own_error(tmp_path):
    from embodied_jax.models.gr00t_inputs import Gr00tInputBuilder, PromptError
    from experiments import demo

    vocab = demo.gr00t_vocabulary()
    builder = Gr00tInputBuilder(
        demo.build_gr00t_tokenizer(tmp_path / "tokenizer.json"),
        camera_names=("ego_view",),
        image_tokens=1,
        image_token_id=vocab.index("<IMG_CONTEXT>"),
        max_token_len=40,
        pad_token=demo.GR00T_PAD,
    )
    assert len(builder.prompt_ids("reach the red target", 1)) < 40
    with pytest.raises(PromptError, match="task: holds the special token <IMG_CONTEXT>") as info:
        builder.prompt_ids("reach <IMG_CONTEXT> the target", 1)
    assert str(tmp_path) not in str(info.value)
    with pytest.raises(PromptError, match="task: the GR00T prompt has"):
        builder.prompt_ids("reach " * 50, 1)


# ---------------------------------------------------------------- decoding: text errors, never a dropped connection
def _scalar(dtype, data):
    return {b"__npgeneric__": True, b"dtype": dtype, b"data": data}


def _array(dtype, data, shape):
    return {b"__ndarray__": True, b"dtype": dtype, b"data": data, b"shape": shape}


def _nested(depth):
    node = {}
    for _ in range(depth):
        node = {"a": node}
    return node


def test_malformed_messages_get_short_text_errors_and_the_connection_stays(bundle, observation):
    cases = {
        "void scalar of 2**26 bytes": ({**observation, "seed": _scalar("V", 2**26)}, "dtype"),
        "int8 of 1000": ({**observation, "seed": _scalar("|i1", 1000)}, "int8"),
        "unknown dtype": ({**observation, "seed": _scalar("<x9", 1)}, "dtype"),
        "seed 2**64 - 1": ({**observation, "seed": 2**64 - 1}, "seed"),
        "float seed": ({**observation, "seed": 1.5}, "seed"),
        "maps 1000 deep": ({**observation, "extra": _nested(1000)}, "deeper"),
        "maps 10 deep": ({**observation, "extra": _nested(10)}, "deeper"),
        "array bytes short of its shape": (
            {**observation, "observation.state": _array("<f4", b"1234", [2**30])},
            "array",
        ),
        "object array": ({**observation, "observation.state": _array("|O", b"", [0])}, "dtype"),
    }
    with running(bundle) as server, _client(server) as client:
        for name, (message, field) in cases.items():
            reply = client.send_raw(wire.packb(message))
            _assert_text_error(reply, field)
            assert client.infer({**observation, "seed": 1})["actions"].shape == bundle.action_shape, name
        reply = client.send_raw(wire.packb({"seed": _scalar("V", 2**26)}))  # 43 bytes, as reported
        _assert_text_error(reply)


def test_a_nan_state_with_a_huge_batch_axis_is_refused_in_one_short_line(bundle, observation):
    width = observation["observation.state"].shape[-1]
    huge = np.full((200_000 // width, width), np.nan, np.float32)  # 0.8 MB of NaN
    with running(bundle, max_message_mb=1.0) as server, _client(server) as client:
        reply = client.send_raw(wire.packb({**observation, "observation.state": huge}))
        _assert_text_error(reply, "observation.state", "one observation")
        reply = client.send_raw(wire.packb({**observation, "observation.state": np.full(width, np.nan, np.float32)}))
        _assert_text_error(reply, "observation.state", "non-finite")
        assert len(reply) < 200


def test_a_long_task_is_refused_before_tokenisation(bundle, observation, monkeypatch):
    seen = []
    real = bundle.transform
    monkeypatch.setattr(bundle, "transform", lambda sample: seen.append(len(sample["task"])) or real(sample))
    with running(bundle, max_message_mb=1.0, max_task_chars=100) as server, _client(server) as client:
        with pytest.raises(ServerError, match="task: 800000 characters, more than the 100 accepted"):
            client.infer({**observation, "task": "x" * 800_000})
        client.infer({**observation, "task": "y" * 100})
    assert seen == [100]


def test_oversized_messages_are_refused_by_name_or_closed_with_1009(bundle, observation):
    with running(bundle) as server:
        limit = server.config.message_limit
        with _client(server) as client:
            reply = client.send_raw(wire.packb({**observation, "pad": np.zeros(limit, np.uint8)}))
            _assert_text_error(reply, "exceeds")
        with _client(server) as client:
            client._connection.send(wire.packb({**observation, "pad": np.zeros(4 * limit, np.uint8)}))
            with pytest.raises(websockets.ConnectionClosedError) as info:
                client._connection.recv()
            assert info.value.rcvd.code == 1009


# ---------------------------------------------------------------- bounded queue, bytes, connections
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
        first = threading.Thread(target=_infer_once, args=(server, {**observation, "seed": 0}))
        first.start()
        time.sleep(0.5)  # the first request is being sampled
        for i in range(8):
            leaver = _client(server)
            leaver._connection.send(wire.packb({**observation, "seed": i}))
            leaver.close()
        first.join(60)
        assert _infer_once(server, {**observation, "seed": 9})["actions"].shape == bundle.action_shape
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
            thread = threading.Thread(target=lambda m=message: results.append(_catch(lambda: _infer_once(server, m))))
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
    with running(bundle, max_batch=1, batch_timeout_ms=1.0) as server, _client(server) as robot:
        robot.infer(_marked(observation))  # answered once: from now on a known robot
        blocker = threading.Thread(target=_infer_once, args=(server, observation))
        blocker.start()
        time.sleep(0.5)  # the blocker is being sampled
        newcomer = threading.Thread(target=_infer_once, args=(server, observation))
        newcomer.start()
        time.sleep(0.3)  # the newcomer waits in the queue first ...
        robot.infer(_marked(observation))  # ... yet the robot is sampled before it
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
        first = threading.Thread(target=_infer_once, args=(server, {**observation, "seed": 0}))
        first.start()
        time.sleep(0.5)
        with pytest.raises(ServerError, match="server busy: too many request bytes in flight"):
            _infer_once(server, {**observation, "seed": 1})
        first.join(60)
        assert server.budget.peak <= server.budget.total
        assert _infer_once(server, {**observation, "seed": 2})["actions"].shape == bundle.action_shape


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
        assert _infer_once(server, observation)["actions"].shape == bundle.action_shape


def test_a_host_refused_again_and_again_is_read_slowly_and_its_answered_robots_are_not(bundle, observation):
    with running(bundle, refusal_backoff_s=1.0) as server, _client(server) as robot:
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
    with running(bundle, max_connections=3, handshake_timeout_s=60.0) as server, _client(server) as robot:
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
            _client(server, api_key="wrong")
        _client(server, api_key="k3y").close()
    assert len(compared) == 2
