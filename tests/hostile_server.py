"""What the hostile-client tests share: the shared demo run's policy with its buckets compiled, one
of its observations, a server in a thread of the test process, and small client helpers."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import numpy as np

from embodied_jax.serve.client import PolicyClient
from embodied_jax.serve.config import ServeConfig
from embodied_jax.serve.requests import MAX_ERROR_BYTES
from embodied_jax.serve.server import PolicyServer

SECRET_PATH = "/srv/models/secret/tokenizer.model"
MARK = 123.0  # a state value that makes the patched policy misbehave


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


def connect_client(server, **kw) -> PolicyClient:
    return PolicyClient("127.0.0.1", server.port, connect_timeout=5, **kw)


def marked(observation):
    state = np.array(observation["observation.state"], np.float32)
    state[0] = MARK
    return {**observation, "observation.state": state}


def concurrently(*calls):
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


def infer_once(server, message):
    with connect_client(server) as client:
        return client.infer(message)


def assert_text_error(reply, *fields):
    assert isinstance(reply, str) and reply.startswith("error: "), reply
    assert len(reply.encode()) <= MAX_ERROR_BYTES
    for field in fields:
        assert field in reply, reply


# ---------------------------------------------------------------- one request's fault stays its own


def warm_bundle(demo_run):
    from embodied_jax import load_policy

    policy = load_policy(demo_run)
    PolicyServer(policy, ServeConfig(max_batch=2)).warm_up()  # buckets 1 and 2, shared by every server here
    return policy


def demo_observation(demo_run):
    from embodied_jax.data.lerobot import LeRobotDataset

    frame = LeRobotDataset(demo_run / "dataset").frame(0, 0)
    raw = {k: np.asarray(v) for k, v in frame.items() if k.startswith("observation.")}
    raw["task"] = frame["task"]
    return raw
