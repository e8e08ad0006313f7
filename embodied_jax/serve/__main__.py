"""``python -m embodied_jax.serve CKPT_DIR [--port 8000] [--host 127.0.0.1] [--max-batch 8] ...``

Loads the policy once (a run directory or an exported policy), compiles every batch bucket,
then serves until SIGTERM or Ctrl-C. ``--api-key`` (or ``EMBODIED_JAX_API_KEY``) makes the
server refuse, at the handshake, any client that does not send ``Authorization: Api-Key KEY``;
a handshake carrying a browser ``Origin`` is refused unless ``--allow-origin`` names it. The
limits on what clients may send or hold are flags (``ServeConfig`` in ``server.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence

from embodied_jax.cli import INPUT_ERRORS, add_verbose_flag, fail

API_KEY_ENV = "EMBODIED_JAX_API_KEY"


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embodied_jax.serve", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a run directory, its checkpoints/ or an exported policy")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    parser.add_argument("--max-batch", type=int, default=8, help="observations per call (buckets 1, 2, 4, ...)")
    parser.add_argument("--batch-timeout-ms", type=float, default=5.0, help="wait for more requests this long")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"default: ${API_KEY_ENV}")
    parser.add_argument("--max-message-mb", type=float, default=8.0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--no-ema", action="store_true", help="serve the trained parameters, not their EMA")
    parser.add_argument("--seed", type=int, default=0, help="of the noise of requests without a seed")
    parser.add_argument("--rtc", action="store_true", help="real-time chunking: accept prefix_actions/inference_delay")
    limits = parser.add_argument_group("limits on clients")
    limits.add_argument("--max-task-chars", type=int, default=1000)
    limits.add_argument("--max-queue", type=int, default=32, help="requests waiting; more are refused 'server busy'")
    limits.add_argument("--max-connections", type=int, default=64, help="at the cap, the most silent is closed")
    limits.add_argument("--max-inflight-mb", type=float, default=128.0, help="request bytes in flight, all clients")
    limits.add_argument("--handshake-timeout-s", type=float, default=5.0)
    limits.add_argument("--send-timeout-s", type=float, default=10.0, help="drop a client not reading its answers")
    limits.add_argument(
        "--refusal-backoff-s",
        type=float,
        default=2.0,
        help="most a host refused again and again waits before it is read (from 50 ms, doubling; 0: off)",
    )
    limits.add_argument(
        "--allow-origin", action="append", default=[], help="a browser Origin to accept (repeatable; default none)"
    )
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("embodied_jax").setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.ERROR)

    from embodied_jax import host_malloc, load_policy
    from embodied_jax.serve.config import ServeConfig
    from embodied_jax.serve.server import PolicyServer

    host_malloc.return_large_buffers()  # clients' large messages go back to the kernel once answered

    try:
        config = ServeConfig(
            host=args.host,
            port=args.port,
            max_batch=args.max_batch,
            batch_timeout_ms=args.batch_timeout_ms,
            api_key=args.api_key or None,
            max_message_mb=args.max_message_mb,
            seed=args.seed,
            rtc=args.rtc,
            max_task_chars=args.max_task_chars,
            max_queue=args.max_queue,
            max_connections=args.max_connections,
            max_inflight_mb=args.max_inflight_mb,
            handshake_timeout_s=args.handshake_timeout_s,
            send_timeout_s=args.send_timeout_s,
            allow_origins=tuple(args.allow_origin),
            refusal_backoff_s=args.refusal_backoff_s,
        )
        ensure_file_descriptors(config.max_connections)
        if args.step is None and not args.no_ema:
            bundle = load_policy(args.checkpoint)
        else:
            bundle = load_policy(args.checkpoint, step=args.step, use_ema=not args.no_ema)
        server = PolicyServer(bundle, config)
        server.warm_up()
        # Everything loaded so far (the policy, JAX's caches) lives as long as the server: keep it out
        # of the garbage collector's full passes, which would otherwise scan it on the event loop.
        gc.freeze()
    except INPUT_ERRORS + (ValueError,) as exc:
        return fail(exc, verbose=args.verbose)

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
