"""What the policy server admits: connections up to a cap, and request bytes within a budget.

``ConnectionTable`` counts every TCP connection from the moment it is accepted (before its
websocket handshake, so idle sockets count too). At the cap, admitting one more closes the
connection that has gone longest without sending a request (a connection still in its
handshake has been silent since it was accepted; one whose request is being served is never
chosen), so a client that keeps reconnecting idle sockets cannot hold the server, and robots
idle between episodes are only closed when the table is full and they are the most silent.

``ByteBudget`` bounds the bytes of requests being decoded, queued, sampled or answered at once,
over all clients; a request that does not fit is refused at once ("server busy").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable


class ConnectionTable:
    """Connections by the time each last sent a request (or was accepted)."""

    def __init__(self, cap: int):
        if cap < 1:
            raise ValueError(f"max_connections={cap} must be >= 1")
        self.cap = cap
        self._silent_since: dict[Hashable, float] = {}
        self._busy: set[Hashable] = set()
        self._answered: dict[Hashable, int] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._silent_since)

    def opened(self, connection: Hashable) -> Hashable | None:
        """Count a new connection; returns the one to close to stay within the cap (None: room
        left, or every other connection is being served)."""
        self._silent_since[connection] = time.monotonic()
        if len(self._silent_since) <= self.cap:
            return None
        idle = [(t, id(c), c) for c, t in self._silent_since.items() if c is not connection and c not in self._busy]
        if not idle:
            return None
        victim = min(idle, key=lambda entry: entry[:2])[2]
        self.closed(victim)
        self.evicted += 1
        return victim

    def request_started(self, connection: Hashable) -> None:
        if connection in self._silent_since:
            self._busy.add(connection)

    def request_finished(self, connection: Hashable, *, answered: bool = False) -> None:
        """The request is done; ``answered``: with actions (not a refusal)."""
        self._busy.discard(connection)
        if connection in self._silent_since:
            self._silent_since[connection] = time.monotonic()
            self._answered[connection] = self._answered.get(connection, 0) + int(answered)

    def answered(self, connection: Hashable) -> int:
        """How many of the connection's requests were answered with actions."""
        return self._answered.get(connection, 0)

    def closed(self, connection: Hashable) -> None:
        self._silent_since.pop(connection, None)
        self._busy.discard(connection)
        self._answered.pop(connection, None)


class ByteBudget:
    """A count of bytes in flight that never exceeds ``total`` (thread-safe)."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"byte budget {total} must be >= 1")
        self.total = total
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def try_acquire(self, size: int) -> bool:
        with self._lock:
            if self.used + size > self.total:
                return False
            self.used += size
            self.peak = max(self.peak, self.used)
            return True

    def release(self, size: int) -> None:
        with self._lock:
            self.used = max(0, self.used - size)
