"""``python -m embodied_jax.serve CKPT_DIR [--port 8000] [--host 127.0.0.1] [--max-batch 8] ...``

Loads the policy once (a run directory or an exported policy), compiles every batch bucket,
then serves until SIGTERM or Ctrl-C. ``--api-key`` (or ``EMBODIED_JAX_API_KEY``) makes the
server refuse, at the handshake, any client that does not send ``Authorization: Api-Key KEY``;
a handshake carrying a browser ``Origin`` is refused unless ``--allow-origin`` names it. Every
setting of ``ServeConfig`` (``serve/config.py``: the limits on what clients may send or hold) is a
flag of its own name, its default stated there once; ``--help`` lists them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import tyro

from embodied_jax.cli import INPUT_ERRORS, parse_flags, run_main
from embodied_jax.serve.config import ServeConfig

if TYPE_CHECKING:
    from embodied_jax.serve.server import PolicyServer

API_KEY_ENV = "EMBODIED_JAX_API_KEY"
PROG = "python -m embodied_jax.serve"


def ensure_file_descriptors(connections: int, spare: int = 64) -> None:
    """Raise the soft open-file limit towards the hard one so ``connections`` sockets (and the
    files the process needs besides) fit; warn when they cannot."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + spare
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            logging.getLogger(__name__).warning(
                "open-file limit %d is below --max-connections %d + %d: lower --max-connections or raise ulimit -n",
                target,
                connections,
                spare,
            )


@dataclasses.dataclass(frozen=True)
class ServeFlags:
    """``python -m embodied_jax.serve``'s command line: the checkpoint, which weights, and the
    server's settings (``ServeConfig``'s fields, each a flag of its own name)."""

    checkpoint: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="CKPT_DIR")]]
    """a run directory, its checkpoints/ or an exported policy"""
    server: Annotated[ServeConfig, tyro.conf.arg(name="")] = ServeConfig()
    step: int | None = None
    """checkpoint step (default: the latest)"""
    no_ema: bool = False
    """serve the trained parameters, not their EMA"""
    noise_scale: float | None = None
    """spread of sampling's initial noise, N(0, s^2): 1 the flow's own, 0 its centre (default: the run's)"""


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("embodied_jax").setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.ERROR)
    started: list[PolicyServer] = []

    def load(args: list[str]) -> None:
        from embodied_jax import host_malloc, load_policy
        from embodied_jax.serve.server import PolicyServer

        flags = parse_flags(
            ServeFlags, args=args, prog="python -m embodied_jax.serve", description=__doc__.splitlines()[0]
        )
        config = flags.server
        if config.api_key is None and os.environ.get(API_KEY_ENV):
            config = dataclasses.replace(config, api_key=os.environ[API_KEY_ENV])
        host_malloc.return_large_buffers()  # clients' large messages go back to the kernel once answered
        ensure_file_descriptors(config.max_connections)
        edits = None if flags.noise_scale is None else {"noise_scale": flags.noise_scale}
        if flags.step is None and not flags.no_ema:
            bundle = load_policy(flags.checkpoint, model_edits=edits)
        else:
            bundle = load_policy(flags.checkpoint, step=flags.step, use_ema=not flags.no_ema, model_edits=edits)
        server = PolicyServer(bundle, config)
        server.warm_up()
        # Everything loaded so far (the policy, JAX's caches) lives as long as the server: keep it out
        # of the garbage collector's full passes, which would otherwise scan it on the event loop.
        gc.freeze()
        started.append(server)

    status = run_main(load, argv, INPUT_ERRORS + (ValueError,))
    if status or not started:
        return status
    server = started[0]
    config = server.config

    def ready(s: PolicyServer) -> None:
        print(f"serving {s.metadata['model']} (step {s.metadata['step']}) on ws://{config.host}:{s.port}", flush=True)

    async def serve_until_signalled() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        await server.run(ready)

    asyncio.run(serve_until_signalled())
    print(f"stopped: {server.served} requests answered, {server.refused} refused", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
