"""The policy server against unkind clients: every fault of docs/reliability.md's serving table.

Each test starts a server in this process (its own event loop in a thread) on the shared demo
run's policy, with limits small enough to reach, and talks to it with real websocket clients
or raw sockets. Faults that need the policy to misbehave (a transform or a batched call that
raises, actions that are not finite) are injected by patching the bundle.
"""

from __future__ import annotations

import numpy as np
import pytest
import websockets

from embodied_jax.bundle import NormStatsError, PolicyBundle
from embodied_jax.serve import wire
from embodied_jax.serve.client import ServerError
from tests.hostile_server import (
    MARK,
    SECRET_PATH,
    assert_text_error,
    concurrently,
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


def test_a_request_whose_preparation_fails_fails_alone_and_leaks_nothing(bundle, observation, monkeypatch):
    real = bundle.transform

    def transform(sample):
        if "POISON" in sample["task"]:
            raise ValueError(f"{SECRET_PATH}: cannot tokenise {sample['task']!r}")
        return real(sample)

    monkeypatch.setattr(bundle, "transform", transform)
    honest_task = "honest robot's private instruction"
    with running(bundle) as server:
        poisoned, honest = concurrently(
            lambda: infer_once(server, {**observation, "task": "POISON", "seed": 1}),
            lambda: infer_once(server, {**observation, "task": honest_task, "seed": 2}),
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
        alone = infer_once(server, {**observation, "seed": 4})["actions"]
        poisoned, honest = concurrently(
            lambda: infer_once(server, {**marked(observation), "seed": 3}),
            lambda: infer_once(server, {**observation, "seed": 4}),
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
    with running(bundle) as server, connect_client(server) as client:
        with pytest.raises(ServerError, match="non-finite actions"):
            client.infer(marked(observation))
        assert np.isfinite(client.infer(observation)["actions"]).all()
        assert server.incidents == 1


def test_statistics_with_nan_are_refused_when_the_policy_loads(bundle):
    stats = {k: v.to_json() for k, v in bundle.stats.items()}
    key = bundle.inputs.action_key
    stats[key]["std"][0] = float("nan")
    with pytest.raises(NormStatsError, match=f"norm_stats\\['{key}'\\]: std"):
        PolicyBundle(bundle.config, bundle.model, stats, step=bundle.step)


def test_a_task_with_a_gr00t_special_token_is_the_task_s_own_error(tmp_path):
    from embodied_jax.models.gr00t.inputs import Gr00tInputBuilder, PromptError
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
    with running(bundle) as server, connect_client(server) as client:
        for name, (message, field) in cases.items():
            reply = client.send_raw(wire.packb(message))
            assert_text_error(reply, field)
            assert client.infer({**observation, "seed": 1})["actions"].shape == bundle.action_shape, name
        reply = client.send_raw(wire.packb({"seed": _scalar("V", 2**26)}))  # 43 bytes, as reported
        assert_text_error(reply)


def test_a_nan_state_with_a_huge_batch_axis_is_refused_in_one_short_line(bundle, observation):
    width = observation["observation.state"].shape[-1]
    huge = np.full((200_000 // width, width), np.nan, np.float32)  # 0.8 MB of NaN
    with running(bundle, max_message_mb=1.0) as server, connect_client(server) as client:
        reply = client.send_raw(wire.packb({**observation, "observation.state": huge}))
        assert_text_error(reply, "observation.state", "one observation")
        reply = client.send_raw(wire.packb({**observation, "observation.state": np.full(width, np.nan, np.float32)}))
        assert_text_error(reply, "observation.state", "non-finite")
        assert len(reply) < 200


def test_a_long_task_is_refused_before_tokenisation(bundle, observation, monkeypatch):
    seen = []
    real = bundle.transform
    monkeypatch.setattr(bundle, "transform", lambda sample: seen.append(len(sample["task"])) or real(sample))
    with running(bundle, max_message_mb=1.0, max_task_chars=100) as server, connect_client(server) as client:
        with pytest.raises(ServerError, match="task: 800000 characters, more than the 100 accepted"):
            client.infer({**observation, "task": "x" * 800_000})
        client.infer({**observation, "task": "y" * 100})
    assert seen == [100]


def test_oversized_messages_are_refused_by_name_or_closed_with_1009(bundle, observation):
    with running(bundle) as server:
        limit = server.config.message_limit
        with connect_client(server) as client:
            reply = client.send_raw(wire.packb({**observation, "pad": np.zeros(limit, np.uint8)}))
            assert_text_error(reply, "exceeds")
        with connect_client(server) as client:
            client._connection.send(wire.packb({**observation, "pad": np.zeros(4 * limit, np.uint8)}))
            with pytest.raises(websockets.ConnectionClosedError) as info:
                client._connection.recv()
            assert info.value.rcvd.code == 1009


# ---------------------------------------------------------------- bounded queue, bytes, connections
