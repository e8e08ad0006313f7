"""One owner per run directory: ``<workdir>/run.lock``, an OS lock plus a record of its holder.

Process 0 of a training job takes the lock before anything is written (the job's other
processes do not contend). The lock is ``fcntl.flock`` on ``run.lock``, held on a file that
stays open for the run, so it cannot be taken while its holder lives, however long the
holder is paused (Ctrl-Z, SIGSTOP), and it goes with the process however it dies. The file
holds a JSON record, written after the OS lock is taken and rewritten in place: host, PID,
the PID's start time (``/proc/<pid>/stat`` field 22; None where there is no ``/proc``), when
the lock was taken, a heartbeat renewed every ``HEARTBEAT_S`` seconds and a random token.
A second trainer is refused with ``RunLockedError`` naming the holder ("in use by process P
on HOST"), or, while the record is still empty or being written, refused as well.

Whether a record with no live OS lock behind it still counts (``stale_reason``):
- an empty or unreadable record counts until the file has been unchanged for
  ``STALE_AFTER_S`` (a holder may be writing it; a crash between creating and writing it
  costs that long);
- this host's record: while its process is alive with the recorded start time (a restarted
  container that reuses the PID, even this process's own, is another process) and, when
  this process holds the OS lock, never (the holder would hold it);
- another host's record: until its heartbeat is ``STALE_AFTER_S`` old.
The heartbeat first reads the record back: once it holds another token (a trainer took the
lock over) or is gone, the holder stops renewing it and ``check()`` raises ``RunLockLostError``;
the trainer calls it before every step and save, so it stops without writing.

Network file systems. On NFS with working locks (NFSv4, or NFSv3 with lockd) ``flock`` is a
lock on the server and excludes trainers on every host. Where ``flock`` fails (``ENOLCK``:
NFS mounted without lock support; some FUSE mounts) the lock falls back, with a warning, to
the record alone: the file is created with ``O_EXCL``, a stale record is taken over only
after ``STALE_AFTER_S`` without a heartbeat (after a host dies, its run directory stays
locked that long), and the taker reads the record back ``SETTLE_S`` later, so of two trainers
taking one stale lock at once the later writer wins and the other is refused. Where
``flock`` succeeds but is local to each host (NFS with ``local_lock=flock`` or ``nolock``,
FUSE mounts that lock in the kernel) nothing can tell, and the same record rules apply
across hosts: a holder paused longer than ``STALE_AFTER_S`` on one host can lose the lock to
a trainer on another, and it then stops at its next heartbeat (within ``HEARTBEAT_S``)
without saving. Readers (``load_policy``, evaluation) never take the lock: they only read.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pathlib
import secrets
import socket
import threading
import time

from embodied_jax.errors import InputError

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
SETTLE_S = 1.0  # without an OS lock: how long a taker waits before checking that it kept the record
_LOCK_WAIT_S = 2.0  # how long the creator of the file waits for its OS lock while another inspects it


class RunLockedError(InputError, RuntimeError):
    """The run directory belongs to another live trainer."""


class RunLockLostError(RunLockedError):
    """Another trainer took over this trainer's lock (it was paused or unreachable past the stale time)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def pid_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22);
    None where it cannot be read (no such process, no ``/proc``)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 is the command name in parentheses, which may itself hold spaces and ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # fields[0] is field 3


def _parse(data: bytes) -> dict | None:
    """The record, or None when it is empty, cut short or not one this module writes."""
    try:
        record = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int) or record["pid"] <= 0:
        return None
    if not all(isinstance(record.get(k), int | float) for k in ("started", "heartbeat")):
        return None
    return record


def _read(path: pathlib.Path) -> dict | None:
    try:
        return _parse(path.read_bytes())
    except FileNotFoundError:
        return None


def stale_reason(
    holder: dict | None, now: float | None = None, *, modified: float | None = None, os_locked: bool = False
) -> str | None:
    """Why a lock's record no longer names a live holder, or None while it may.

    ``modified``: when the lock file last changed (what an unreadable record is judged by);
    ``os_locked``: this process holds the OS lock on the file, so no process on this host does.
    """
    now = time.time() if now is None else now
    if holder is None:
        if modified is not None and now - modified > STALE_AFTER_S:
            return f"the lock file is unreadable and unchanged for {now - modified:.0f} s"
        return None
    pid = holder["pid"]
    if holder.get("host") == socket.gethostname():
        if not _pid_alive(pid):
            return f"process {pid} is gone"
        recorded, current = holder.get("pid_start"), pid_start(pid)
        if recorded is not None and current is not None and recorded != current:
            return f"process {pid} is not the one that took the lock (started at tick {current}, not {recorded})"
        if os_locked:
            return f"process {pid} does not hold the lock"
        return None
    age = now - holder["heartbeat"]
    if age > STALE_AFTER_S:
        return f"its heartbeat is {age:.0f} s old"
    return None


def _flock(fd: int, wait: float) -> bool | None:
    """Take the OS lock: True once held, False while another holds it, None where the file
    system has no ``flock`` (the record alone then guards the directory)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        except OSError as e:
            if e.errno == errno.EINTR:
                continue
            log.warning("run.lock: no OS lock on this file system (%s): relying on its record and heartbeat", e)
            return None


def _same_file(fd: int, path: pathlib.Path) -> bool:
    """The open file is still the one at ``path`` (not released and removed since it was opened)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return here.st_nlink > 0 and (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class RunLock:
    """``with RunLock(workdir):`` holds the run directory for the block."""

    def __init__(self, workdir: str | os.PathLike):
        self.path = pathlib.Path(workdir) / LOCK_NAME
        self.lost: str | None = None  # why the lock was lost, once another trainer took it over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record: dict | None = None
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # the file can be released and removed between opening and locking it
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, os.O_RDWR), False
                except FileNotFoundError:
                    continue
            try:
                if self._take(fd, created):
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise RunLockedError(f"{self.path} keeps changing: another trainer is starting in {self.path.parent}")

    def _take(self, fd: int, created: bool) -> bool:
        """Own the lock through ``fd``; False when the file was replaced meanwhile (try again)."""
        # The creator may find the OS lock held briefly by another trainer inspecting the new file.
        os_locked = _flock(fd, _LOCK_WAIT_S if created else 0.0)
        if os_locked is False:
            raise self._refusal(_parse(os.pread(fd, 1 << 16, 0)))
        if not _same_file(fd, self.path):
            return False
        took_over = False
        if not created:
            holder = _parse(os.pread(fd, 1 << 16, 0))
            reason = stale_reason(holder, modified=os.fstat(fd).st_mtime, os_locked=bool(os_locked))
            if reason is None:
                raise self._refusal(holder)
            log.warning("taking over the stale lock %s: %s", self.path, reason)
            took_over = True
        now = time.time()
        self._fd = fd
        self._record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": pid_start(os.getpid()),
            "started": now,
            "heartbeat": now,
            "token": secrets.token_hex(8),
        }
        self._write()
        if took_over and not os_locked:
            time.sleep(SETTLE_S)  # another trainer taking the same stale record may write after this one
            holder = _read(self.path)
            if holder is None or holder.get("token") != self._record["token"]:
                self._fd = None
                raise self._refusal(holder)
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return True

    def _refusal(self, holder: dict | None) -> RunLockedError:
        if holder is None:
            return RunLockedError(
                f"{self.path.parent} is in use by another trainer (its lock record {self.path} is being written or "
                f"unreadable; it counts as stale after {STALE_AFTER_S:.0f} s unchanged); stop it or choose another "
                f"--workdir"
            )
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        return RunLockedError(
            f"{self.path.parent} is in use by process {holder.get('pid')} on {holder.get('host')} "
            f"(since {since}); stop it or choose another --workdir"
        )

    def _write(self) -> None:
        data = json.dumps(self._record).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        os.fsync(self._fd)  # other hosts of a network file system see the heartbeat

    def heartbeat(self) -> bool:
        """Renew the record while this process still owns it; False (and ``lost`` set) once not."""
        holder = _read(self.path)
        if holder is None and self.path.exists():
            return True  # being rewritten by a taker: the next beat reads who
        if holder is None or holder.get("token") != self._record["token"]:
            taker = "removed" if holder is None else f"taken by process {holder.get('pid')} on {holder.get('host')}"
            age = time.time() - self._record["heartbeat"]
            self.lost = (
                f"{self.path} was {taker} while this trainer did not renew it for {age:.0f} s (paused, or its file "
                f"system unreachable); this trainer stopped without saving, so as not to write into that run"
            )
            log.error("%s", self.lost)
            return False
        self._record = dict(self._record, heartbeat=time.time())
        self._write()
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.heartbeat():
                return

    def check(self) -> None:
        """Raise ``RunLockLostError`` once another trainer has taken the lock over."""
        if self.lost is not None:
            raise RunLockLostError(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._fd is None:
            return
        holder = _read(self.path)
        if self.lost is None and holder is not None and holder.get("token") == self._record["token"]:
            self.path.unlink(missing_ok=True)  # before closing: nobody can take the OS lock on it meanwhile
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
