"""What a long experiment tells its user while it runs: the expected duration at the start (from the
recorded runs of the same command, ``experiments/record.py``) and a line at least every 30 seconds
while a phase prints nothing of its own (``heartbeat``)."""

from __future__ import annotations

import contextlib
import pathlib
import sys
import threading
import time
from collections.abc import Iterator

from embodied_jax import records
from experiments.benchmarks.harness import RESULTS
from experiments.record import command_overrides, setting

HEARTBEAT_S = 30.0


def expected_duration(
    name: str,
    overrides: list[str] | None = None,
    results: pathlib.Path = RESULTS,
    setting_hash: str | None = None,
) -> str:
    """The latest clean row in ``results/<name>.jsonl`` of this command's setting (its overrides
    less the training seed, run directory and bookkeeping flags, ``record.setting``): its wall time,
    its split, its machine and whether other work shared the machine; or that there is none yet.
    With ``setting_hash`` (``records.setting_hash`` of the config as launched), a row of the same
    config is preferred, and a row of the same flags whose config differs (a default changed since,
    or a row from before rows carried the hash) is shown as such."""
    wanted = setting(list(command_overrides(sys.argv[1:]) if overrides is None else overrides))
    path = results / f"{name}.jsonl"
    rows = records.read(path)
    same = [r for r in rows if r.get("clean") and setting(r.get("overrides", [])) == wanted]
    if not same:
        return f"expected duration: no recorded run of this command yet (results/{name}.jsonl)"
    exact = [r for r in same if setting_hash is not None and r.get("setting_hash") == setting_hash]
    row = (exact or same)[-1]
    caveat = ""
    if setting_hash is not None and not exact:
        caveat = (
            "; that run's defaults differed from this checkout's, so take it as a rough guide"
            if "setting_hash" in row
            else "; that row predates config hashes in rows, so its defaults may differ from this checkout's"
        )
    wall = row.get("wall_s", {})
    split = ", ".join(f"{k} {v / 60:.1f}" for k, v in wall.items())
    machine = row.get("machine", {})
    alone = "with other work on the machine" if machine.get("shared") else "alone on the machine"
    return (
        f"expected duration: {sum(wall.values()) / 60:.1f} min ({split}) in the run recorded at "
        f"{row.get('commit')}, {machine.get('cores', '?')} cores, {alone}{caveat}"
    )


@contextlib.contextmanager
def heartbeat(phase: str, every: float = HEARTBEAT_S, out=None) -> Iterator[None]:
    """Print ``phase: still running (N s)`` every ``every`` seconds until the block ends (a jitted
    rollout or a compile prints nothing of its own for minutes)."""
    out = out or sys.stdout
    stop = threading.Event()
    start = time.perf_counter()

    def beat():
        while not stop.wait(every):
            print(f"      {phase}: still running ({time.perf_counter() - start:.0f} s)", file=out, flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
