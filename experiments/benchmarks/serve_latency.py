"""Policy-server latency and load on localhost: request latency p50/p99 and requests/s.

    python -m experiments.benchmarks.serve_latency --policy RUN_DIR            # a trained policy
    python -m experiments.benchmarks.serve_latency --models pi05_bench gr00t_bench

For each policy and each ``--max-batch`` (the server's largest bucket; 1 = no batching), a
server (``embodied_jax.serve``) runs in this process on a free port, compiles its buckets, and
1, 4 and 16 concurrent clients (one thread and one websocket each) send ``--requests``
observations each, back to back. Every request is counted as answered or refused (with the
reason); latency is the client's round trip. ``pi05_bench``/``gr00t_bench`` are the CPU
benchmark sizes with random weights and made-up statistics (a stand-in with real shapes:
speed only). Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import pathlib
import sys
import tempfile
import threading
import time

import jax
import numpy as np
import tyro

from embodied_jax.cli import parse_flags
from embodied_jax.errors import InputError
from experiments.benchmarks import harness

STAND_INS = ("pi05_tiny", "pi05_bench", "pi05", "gr00t_tiny", "gr00t_bench", "gr00t_n15")


def stand_in_bundle(name: str, workdir: pathlib.Path):
    """A ``PolicyBundle`` of a named model size (``STAND_INS``: the families' variants; ``pi05`` and
    ``gr00t_n15`` the published sizes at their published step counts) with random weights, 8 state
    dims, a tokenizer of the demo's kind and statistics of N(0, 1) data."""
    from flax import nnx

    from embodied_jax.bundle import PolicyBundle
    from embodied_jax.data.pipeline import DataConfig
    from embodied_jax.data.sample_transform import ModelInputs
    from embodied_jax.data.samples import SampleSpec
    from embodied_jax.data.sources import LeRobotData
    from embodied_jax.data.stats import iter_values
    from embodied_jax.parallel.mesh import MeshConfig, make_mesh
    from embodied_jax.parallel.sharding import mesh_context
    from embodied_jax.train.config import ExperimentConfig
    from experiments import demo

    family, _, size_name = name.partition("_")
    size_name = {"": "full", "n15": "full"}.get(size_name, size_name)
    if family == "pi05" and size_name in ("tiny", "bench", "full"):
        from embodied_jax.models.pi05.variants import variant

        # The demo's word-level tokenizer: ids stay below 1024 whatever the model's vocabulary.
        tokenizer = demo.build_tokenizer(workdir / "tokenizer.model", 1024)
        model = dataclasses.replace(variant(size_name), tokenizer_path=str(tokenizer))
        norm = "quantile"
    elif family == "gr00t" and size_name in ("tiny", "bench", "full"):
        from embodied_jax.models.gr00t.variants import variant

        vocab = demo.gr00t_vocabulary()
        tokenizer = demo.build_gr00t_tokenizer(workdir / "tokenizer.json")
        model = variant(size_name)
        model = dataclasses.replace(
            model,
            tokenizer_path=str(tokenizer),
            image_token_id=vocab.index("<IMG_CONTEXT>"),
            llm=dataclasses.replace(model.llm, vocab_size=max(model.llm.vocab_size, len(vocab))),
            embodiment_id=min(model.embodiment_id, model.action_head.max_num_embodiments - 1),
            max_token_len=max(model.max_token_len, 64),  # room for the prompt beside the image tokens
        )
        norm = "min_max"
    else:
        raise ValueError(f"--models: {name!r} is not one of {', '.join(STAND_INS)}")
    size = model.vision.image_size
    cameras = tuple((f"observation.images.{slot}", slot) for slot in model.camera_names)
    data = LeRobotData(
        DataConfig(
            sources=(),
            spec=SampleSpec(action_horizon=model.action_horizon),
            image_size=(size, size),
            norm_modes=(("observation.state", norm), ("action", norm)),
        ),
        ModelInputs(cameras=cameras),
    )
    config = ExperimentConfig(name=name, model=model, data=data, mesh=MeshConfig(data=-1))
    rng = np.random.default_rng(0)
    stats = {
        "observation.state": iter_values([rng.normal(size=(512, 8))]).to_json(),
        "action": iter_values([rng.normal(size=(512, model.action_dim))]).to_json(),
    }
    mesh = make_mesh(MeshConfig(data=-1), jax.local_devices()[:1])
    with mesh_context(mesh):
        policy = nnx.jit(lambda: model.make(nnx.Rngs(0)))()
    return PolicyBundle(config, policy, stats, step=0)


class RunningServer:
    """A ``PolicyServer`` on its own event loop in a background thread."""

    def __init__(self, bundle, max_batch: int, batch_timeout_ms: float = 5.0, **limits):
        from embodied_jax.serve.config import ServeConfig
        from embodied_jax.serve.server import PolicyServer

        config = ServeConfig(port=0, max_batch=max_batch, batch_timeout_ms=batch_timeout_ms, **limits)
        self.server = PolicyServer(bundle, config)
        t0 = time.perf_counter()
        self.server.warm_up()
        self.compile_s = time.perf_counter() - t0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(
            target=lambda: self.loop.run_until_complete(self.server.run(lambda _: ready.set())), daemon=True
        )
        self.thread.start()
        if not ready.wait(120):
            raise RuntimeError("the server did not start")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.stop)
        self.thread.join(60)


def _load(port: int, observation: dict, clients: int, requests: int) -> dict:
    from embodied_jax.serve.client import PolicyClient, ServerError

    latencies, refused, batch_sizes = [], collections.Counter(), []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def run(index: int) -> None:
        with PolicyClient("127.0.0.1", port) as client:
            barrier.wait()
            for i in range(requests):
                t0 = time.perf_counter()
                try:
                    reply = client.infer({**observation, "seed": index * 10_000 + i})
                except ServerError as e:
                    with lock:
                        refused[str(e)[:80]] += 1
                    continue
                with lock:
                    latencies.append((time.perf_counter() - t0) * 1e3)
                    batch_sizes.append(reply["server_timing"]["batch_size"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = np.asarray(latencies)
    return {
        "clients": clients,
        "sent": clients * requests,
        "answered": len(latencies),
        "refused": dict(refused),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "requests_per_s": len(latencies) / wall,
        "mean_batch": float(np.mean(batch_sizes)) if batch_sizes else None,
    }


@dataclasses.dataclass(frozen=True)
class Flags:
    """serve_latency's command line."""

    policy: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """a trained run or exported policy"""
    models: tuple[str, ...] = ()
    """stand-in sizes: pi05_tiny, pi05_bench, pi05, gr00t_tiny, gr00t_bench, gr00t_n15"""
    clients: tuple[int, ...] = (1, 4, 16)
    max_batch: tuple[int, ...] = (1, 4, 8)
    requests: int = 16
    """per client"""


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.serve_latency", description=__doc__.splitlines()[0]
    )
    if not args.policy and not args.models:
        raise InputError("serve_latency: name at least one --policy RUN_DIR or --models NAME")

    from embodied_jax import load_policy
    from embodied_jax.serve.server import PolicyServer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        named = [(p, lambda p=p: load_policy(p)) for p in args.policy]
        named += [(m, lambda m=m: stand_in_bundle(m, pathlib.Path(tmp))) for m in args.models]
        for name, make in named:
            bundle = make()
            observation = PolicyServer(bundle).example_observation()
            for max_batch in args.max_batch:
                running = RunningServer(bundle, max_batch)
                try:
                    for clients in args.clients:
                        row = {"policy": name, "max_batch": max_batch, "compile_s": running.compile_s}
                        row.update(_load(running.server.port, observation, clients, args.requests))
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
                finally:
                    running.close()
    print("| policy | max batch | clients | answered/sent | refused | p50 ms | p99 ms | req/s | mean batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['max_batch']} | {r['clients']} | {r['answered']}/{r['sent']} | "
            f"{sum(r['refused'].values())} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['requests_per_s']:.2f} | "
            f"{r['mean_batch']:.2f} |"
        )
    print(json.dumps({"serve_latency": rows}))
    return rows


if __name__ == "__main__":
    sys.exit(harness.run(main, "serve_latency"))  # --record: the result appended to results/serve_latency.jsonl
