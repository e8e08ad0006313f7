"""The policy server end to end: a real server process on a free localhost port, real clients.

One server (with an API key) serves every test of the module; the last one stops it with
SIGTERM. Its answers are compared with the same checkpoint's ``load_policy(...).predict``.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import urllib.request

import jax
import numpy as np
import pytest

from embodied_jax.serve import wire
from embodied_jax.serve.client import PolicyClient, ServerError

KEY = "test-key"


@pytest.fixture(scope="module")
def server(demo_run, subprocess_env):
    proc = subprocess.Popen(
        [sys.executable, "-m", "embodied_jax.serve", str(demo_run), "--port", "0", "--max-batch", "2"]
        + ["--batch-timeout-ms", "300", "--api-key", KEY, "--max-message-mb", "1", "--rtc"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        found = re.search(r"on ws://[\d.]+:(\d+)", line)
        if found:
            break
    else:
        raise AssertionError("the server did not start:\n" + "".join(lines))
    yield proc, int(found.group(1))
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def observation(demo_run):
    from embodied_jax.data.lerobot import LeRobotDataset

    frame = LeRobotDataset(demo_run / "dataset").frame(0, 0)
    raw = {k: np.asarray(v) for k, v in frame.items() if k.startswith("observation.")}
    raw["task"] = frame["task"]
    return raw


def _client(server, **kw):
    return PolicyClient("127.0.0.1", server[1], api_key=kw.pop("api_key", KEY), **kw)


def test_a_client_gets_metadata_and_actions_equal_to_predict(server, observation, demo_run):
    from embodied_jax import load_policy

    with _client(server) as client:
        meta = client.metadata
        assert meta["model"] == "Pi05Config" and meta["step"] == 4 and meta["rtc"]
        state = list(observation["observation.state"].shape)
        assert meta["observation"]["observation.state"] == {"shape": state, "dtype": "float32"}
        assert meta["observation"]["task"]["dtype"] == "str"
        reply = client.infer({**observation, "seed": 11})
    bundle = load_policy(demo_run)
    expected = bundle.predict(observation, rng=jax.random.key(11))
    assert reply["actions"].shape == tuple(meta["action"]["shape"]) == expected.shape
    np.testing.assert_allclose(reply["actions"], expected, atol=1e-5)
    assert reply["server_timing"]["batch_size"] == 1 and reply["server_timing"]["infer_ms"] > 0


def test_openpi_spellings_are_accepted(server, observation):
    nested = {
        "observation": {"state": observation["observation.state"], "images": {}},
        "prompt": observation["task"],
        "seed": 11,
    }
    for key, value in observation.items():
        if key.startswith("observation.images."):
            nested["observation"]["images"][key.removeprefix("observation.images.")] = value
    flat = {k.replace(".", "/"): v for k, v in observation.items()} | {"seed": 11}
    with _client(server) as client:
        reference = client.infer({**observation, "seed": 11})["actions"]
        np.testing.assert_array_equal(client.infer(nested)["actions"], reference)
        np.testing.assert_array_equal(client.infer(flat)["actions"], reference)


def test_two_concurrent_clients_are_served_by_one_call(server, observation):
    replies = {}
    barrier = threading.Barrier(2)

    def ask(seed):
        with _client(server) as client:
            barrier.wait()
            replies[seed] = client.infer({**observation, "seed": seed})

    threads = [threading.Thread(target=ask, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [replies[s]["server_timing"]["batch_size"] for s in (1, 2)] == [2, 2]
    assert not np.allclose(replies[1]["actions"], replies[2]["actions"])  # each row its own noise
    with _client(server) as client:  # and a row's actions do not depend on its batch-mates
        alone = client.infer({**observation, "seed": 1})["actions"]
    np.testing.assert_allclose(alone, replies[1]["actions"], atol=1e-5)


def _bad_inputs(observation):
    camera = next(k for k in observation if k.startswith("observation.images."))
    image = observation[camera]
    nan_state = observation["observation.state"].copy()
    nan_state[0] = np.nan
    return {
        "missing camera": ({k: v for k, v in observation.items() if k != camera}, camera),
        "state shape": ({**observation, "observation.state": np.zeros(3, np.float32)}, "observation.state"),
        "image dtype": ({**observation, camera: image.astype(np.float32)}, camera),
        "image size": ({**observation, camera: np.zeros((7, 9, 3), np.uint8)}, camera),
        "non-finite state": ({**observation, "observation.state": nan_state}, "observation.state"),
        "batched": ({**observation, "observation.state": observation["observation.state"][None]}, "observation.state"),
        "seed": ({**observation, "seed": "seven"}, "seed"),
    }


def test_bad_input_is_named_and_harms_no_one(server, observation):
    with _client(server) as bad, _client(server) as good:
        for name, (message, field) in _bad_inputs(observation).items():
            with pytest.raises(ServerError, match=re.escape(field)):
                bad.infer(message)
            assert good.infer({**observation, "seed": 3})["actions"].shape[0] > 0, name
        assert "not msgpack-numpy" in bad.send_raw(b"\xc1 not msgpack")
        assert "text frame" in bad.send_raw("hello")
        assert "exceeds" in bad.send_raw(wire.packb({**observation, "pad": np.zeros(2**20, np.uint8)}))
        assert bad.infer({**observation, "seed": 3})["actions"].shape[0] > 0  # still usable


def test_a_client_that_leaves_mid_request_costs_only_its_answer(server, observation):
    leaver = _client(server)
    leaver._connection.send(wire.packb({**observation, "seed": 5}))
    leaver._connection.close()
    with _client(server) as client:
        assert client.infer({**observation, "seed": 5})["actions"].shape[0] > 0


def test_the_api_key_is_checked_at_the_handshake_and_healthz_answers(server):
    from websockets.exceptions import InvalidStatus

    for key in (None, "wrong"):
        with pytest.raises(InvalidStatus, match="401"):
            _client(server, api_key=key, connect_timeout=0)
    with urllib.request.urlopen(f"http://127.0.0.1:{server[1]}/healthz") as response:
        assert response.status == 200


def test_real_time_chunking_keeps_the_actions_that_execute_during_inference(server, observation):
    """With ``--rtc``, a request carrying the previous chunk's remaining actions gets a chunk whose
    first ``inference_delay`` actions are those (they run while it is sampled)."""
    with _client(server) as client:
        previous = client.infer({**observation, "seed": 21})["actions"]
        executed, delay = 2, 2
        prefix = previous[executed:]
        guided = client.infer({**observation, "seed": 22, "prefix_actions": prefix, "inference_delay": delay})
        plain = client.infer({**observation, "seed": 22})["actions"]
        np.testing.assert_allclose(guided["actions"][:delay], prefix[:delay], atol=1e-4)
        assert not np.allclose(plain[:delay], prefix[:delay], atol=1e-3)
        with pytest.raises(ServerError, match="prefix_actions"):
            client.infer({**observation, "prefix_actions": prefix[:, :1], "inference_delay": 1})


def test_sigterm_shuts_the_server_down_cleanly(server):
    proc, _ = server
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert re.search(r"stopped: \d+ requests answered, \d+ refused", out)
