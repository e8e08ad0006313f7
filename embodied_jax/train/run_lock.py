"""One owner per run directory: an exclusive lock file with its holder's host, PID and heartbeat.

Process 0 of a training job takes ``<workdir>/run.lock`` before anything is written
(the job's other processes do not contend) and refreshes its heartbeat every
``HEARTBEAT_S`` seconds from a daemon thread. A second trainer on the same workdir is
refused with ``RunLockedError`` naming the holder. A lock is stale, and taken over with
a warning, when its PID is gone on this host or its heartbeat is older than
``STALE_AFTER_S`` (a holder on another host that died). Readers (``load_policy``,
evaluation) never take it: they only read.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket
import threading
import time

from embodied_jax.errors import InputError

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0


class RunLockedError(InputError, RuntimeError):
    """The run directory belongs to another live trainer."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _read(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def stale_reason(holder: dict | None, now: float | None = None) -> str | None:
    """Why a lock's holder no longer owns it, or None while it does."""
    if holder is None:
        return "the lock file is unreadable"
    now = time.time() if now is None else now
    age = now - float(holder.get("heartbeat", 0.0))
    if age > STALE_AFTER_S:
        return f"its heartbeat is {age:.0f} s old"
    if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
        return f"process {holder.get('pid')} is gone"
    return None


class RunLock:
    """``with RunLock(workdir):`` holds the run directory for the block."""

    def __init__(self, workdir: str | os.PathLike):
        self.path = pathlib.Path(workdir) / LOCK_NAME
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record: dict | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "heartbeat": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read(self.path)
                reason = stale_reason(holder)
                if reason is None:
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))
                    raise RunLockedError(
                        f"{self.path.parent} is in use by process {holder.get('pid')} on {holder.get('host')} "
                        f"(since {since}); stop it or choose another --workdir"
                    ) from None
                log.warning("taking over the stale lock %s: %s", self.path, reason)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self._record = record
            self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
            self._thread.start()
            return
        raise RunLockedError(f"{self.path}: another process took the lock while this one replaced a stale one")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            record = dict(self._record, heartbeat=time.time())
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        holder = _read(self.path)
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
