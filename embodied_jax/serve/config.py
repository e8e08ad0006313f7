"""The policy server's settings: where it listens, how it batches, and every limit on what a client
controls (``docs/reliability.md`` lists each limit and what happens beyond it)."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

import tyro


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The server's settings; ``python -m embodied_jax.serve`` takes each as a flag (``--max-batch``)."""

    host: str = "127.0.0.1"
    """address to bind (default: this machine only)"""
    port: int = 8000
    """0: any free port (printed)"""
    max_batch: int = 8
    """observations per call (compiled buckets 1, 2, 4, ..., max_batch)"""
    batch_timeout_ms: float = 5.0
    """wait for more requests this long"""
    api_key: str | None = None
    """clients must send 'Authorization: Api-Key KEY' (the command line's default: $EMBODIED_JAX_API_KEY)"""
    max_message_mb: float = 8.0
    """largest message; robot observations are well under it, and each costs the event loop a copy"""
    seed: int = 0
    """of the noise of requests without a seed"""
    rtc: bool = False
    """real-time chunking: requests may carry prefix_actions and inference_delay"""
    max_task_chars: int = 1000
    """longest task string"""
    max_queue: int = 32
    """requests waiting for inference; more are refused 'server busy'"""
    max_connections: int = 64
    """at the cap, the connection silent longest is closed (admission.py)"""
    max_inflight_mb: float = 128.0
    """request bytes in flight over all clients"""
    handshake_timeout_s: float = 5.0
    """a client must finish its handshake this fast"""
    send_timeout_s: float = 10.0
    """a client that does not read its answer for this long is disconnected"""
    write_limit_kb: int = 64
    """websockets' write buffer per connection"""
    allow_origins: Annotated[
        tyro.conf.UseAppendAction[tuple[str, ...]], tyro.conf.arg(aliases=("--allow-origin",))
    ] = ()
    """a browser Origin to accept (repeatable; default none)"""
    refusal_backoff_s: float = 2.0
    """most a host refused again and again waits before it is read (from 50 ms, doubling; 0: off)"""

    def __post_init__(self):
        for name in ("max_batch", "max_task_chars", "max_queue", "max_connections", "write_limit_kb"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("max_message_mb", "max_inflight_mb", "handshake_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServeConfig.{name}={getattr(self, name)} must be > 0")
        if not self.refusal_backoff_s >= 0:
            raise ValueError(f"ServeConfig.refusal_backoff_s={self.refusal_backoff_s} must be >= 0")
        if 2 * self.message_limit > self.inflight_limit:
            raise ValueError(
                f"ServeConfig.max_inflight_mb={self.max_inflight_mb} must hold two messages of "
                f"max_message_mb={self.max_message_mb} (a message and its decoded arrays)"
            )

    @property
    def message_limit(self) -> int:
        return int(self.max_message_mb * 2**20)

    @property
    def inflight_limit(self) -> int:
        return int(self.max_inflight_mb * 2**20)


def buckets(max_batch: int) -> tuple[int, ...]:
    """The compiled batch sizes: powers of two below ``max_batch``, and ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be >= 1")
    sizes = [2**i for i in range(int(math.log2(max_batch)) + 1) if 2**i < max_batch]
    return (*sizes, max_batch)
