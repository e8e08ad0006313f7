"""glibc malloc settings: a training process reuses its memory from step to step; a server
returns clients' large buffers (``return_large_buffers``).

XLA:CPU allocates a step's buffers afresh on every call (0.2-1.1 GB at the benchmark sizes),
and glibc returns every allocation above its mmap threshold (at most 32 MiB) to the kernel
when it is freed. The next step then page-faults the same memory back in, zero-filled by the
kernel: measured on the 2-core CPU, π0.5 BENCH took 260k faults (1.06 GB of 4 KiB pages) and
0.6 s of system time per step, GR00T BENCH trainable 175k and 0.35-0.42 s. With every
allocation served from the main heap and the heap never trimmed (``REUSE``), steps reuse the
pages of the previous step: no faults, 0.02-0.04 s of system time.

glibc reads ``GLIBC_TUNABLES`` only when a process starts, so ``reexec()`` (called first by the
command lines: ``experiments.launch`` and the benchmarks) restarts the command once with them:
same PID, arguments and interpreter options. It does nothing off glibc, when ``GLIBC_TUNABLES``
already sets a ``glibc.malloc`` tunable (the user's choice, and the restarted process), or
with ``EMBODIED_JAX_MALLOC=system``.
"""

from __future__ import annotations

import os
import sys

REUSE = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"
OPT_OUT = "EMBODIED_JAX_MALLOC"


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


def tuned_environment(env: dict[str, str], *, glibc: bool | None = None) -> dict[str, str] | None:
    """``env`` with ``REUSE`` added to ``GLIBC_TUNABLES``, or None when nothing is to change."""
    if env.get(OPT_OUT, "").lower() == "system" or not (_glibc() if glibc is None else glibc):
        return None
    current = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in current:
        return None
    return {**env, "GLIBC_TUNABLES": f"{current}:{REUSE}" if current else REUSE}


def mode() -> str:
    """What this process runs with: ``reuse`` (``REUSE`` in effect) or ``system``."""
    return "reuse" if REUSE in os.environ.get("GLIBC_TUNABLES", "") else "system"


def reexec() -> None:
    """Restart this command with ``REUSE`` when ``tuned_environment`` asks for it (never returns then)."""
    env = tuned_environment(dict(os.environ))
    if env is None or not getattr(sys, "orig_argv", None):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


SERVER_MMAP_THRESHOLD = 1 << 20


def return_large_buffers(threshold: int = SERVER_MMAP_THRESHOLD) -> bool:
    """For a long-running server (the opposite trade to ``REUSE``): every allocation of at least
    ``threshold`` bytes is mmapped and goes back to the kernel when freed. glibc otherwise raises
    its mmap threshold to the largest block freed so far (up to 32 MiB), after which clients'
    large messages are served from heaps that keep their memory. Returns whether it applied
    (glibc only; not with ``EMBODIED_JAX_MALLOC=system``)."""
    if os.environ.get(OPT_OUT, "").lower() == "system" or not _glibc():
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(libc.mallopt(m_trim_threshold, 2 * threshold))
