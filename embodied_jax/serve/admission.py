"""What the policy server admits: connections up to a cap, and request bytes within a budget.

``ConnectionTable`` counts every TCP connection from the moment it is accepted (before its
websocket handshake, so idle sockets count too). At the cap, admitting one more closes the
connection that has gone longest without sending a request (a connection still in its
handshake has been silent since it was accepted; one whose request is being served is never
chosen), so a client that keeps reconnecting idle sockets cannot hold the server, and robots
idle between episodes are only closed when the table is full and they are the most silent.

``ByteBudget`` bounds the bytes of requests being decoded, queued, sampled or answered at once,
over all clients; a request that does not fit is refused at once ("server busy").

``RefusalBackoff`` makes a host that keeps sending requests it is refused for (malformed,
oversized, failing the checks; not "server busy") wait before it is read again: nothing for its
first refusal, then ``base_s`` doubling per refusal up to ``max_s``, forgotten after ``forget_s``
without one. The server stops reading the connection while it waits, so the client's own sends
block instead of the server's CPU decoding them; a host that reconnects keeps its count. Hosts
that are never refused (robots beside an attacker on the same machine) never wait.
"""

from __future__ import annotations

import collections
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


class RefusalBackoff:
    """How long each host waits before its next request is read, by its recent refusals."""

    def __init__(self, max_s: float, base_s: float = 0.05, forget_s: float = 60.0, max_hosts: int = 4096):
        if max_s < 0 or base_s <= 0 or forget_s <= 0 or max_hosts < 1:
            raise ValueError(f"refusal backoff: max_s={max_s} >= 0, base_s={base_s}, forget_s={forget_s} > 0")
        self.max_s, self.base_s, self.forget_s, self.max_hosts = max_s, base_s, forget_s, max_hosts
        self._hosts: collections.OrderedDict[Hashable, tuple[int, float]] = collections.OrderedDict()

    def _strikes(self, host: Hashable, now: float) -> int:
        strikes, last = self._hosts.get(host, (0, now))
        return strikes if now - last < self.forget_s else 0

    def refused(self, host: Hashable) -> None:
        now = time.monotonic()
        self._hosts[host] = (self._strikes(host, now) + 1, now)
        self._hosts.move_to_end(host)
        while len(self._hosts) > self.max_hosts:  # the host refused least recently is forgotten
            self._hosts.popitem(last=False)

    def delay(self, host: Hashable) -> float:
        """Seconds ``host`` waits before its next request is read (0: none)."""
        strikes = self._strikes(host, time.monotonic())
        if strikes < 2 or self.max_s == 0:
            return 0.0
        return min(self.base_s * 2.0 ** min(strikes - 2, 30), self.max_s)
