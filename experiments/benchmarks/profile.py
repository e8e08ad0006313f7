"""Per-op time of one compiled step from JAX's profiler (``--profile DIR`` of the benchmarks).

``profile_step(run, out_dir)`` traces one call of ``run()`` with ``jax.profiler`` (a
Perfetto trace under ``out_dir``), then sums the device-side durations of the HLO ops by
name and by kind (the name up to its first ``.``: ``ynn_fusion`` = XLA:CPU matmul fusions,
``copy_*`` = transposing copies, ...). Durations of ops that run concurrently overlap, so
shares are of summed op time, not of wall time. ``describe(hlo_text, name)`` gives an op's
shape and the JAX operation it came from; ``report`` leaves the step's HLO beside the trace
(``hlo.txt``).
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re

import jax

_RUNTIME = ("Thunk", "$", "Slinky", "while", "PjitFunction", "ProfilerSession")


def profile_step(run, out_dir) -> tuple[collections.Counter, collections.Counter]:
    """(milliseconds per op name, milliseconds per op kind) of one ``run()``."""
    out_dir = pathlib.Path(out_dir)
    jax.profiler.start_trace(str(out_dir), create_perfetto_trace=True)
    try:
        jax.block_until_ready(run())
    finally:
        jax.profiler.stop_trace()
    trace = max(out_dir.glob("**/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    per_op: collections.Counter = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and not event["name"].startswith(_RUNTIME):
            per_op[event["name"]] += event.get("dur", 0) / 1000.0
    per_kind: collections.Counter = collections.Counter()
    for name, ms in per_op.items():
        per_kind[name.split(".")[0]] += ms
    return per_op, per_kind


def describe(hlo_text: str, name: str) -> str:
    match = re.search(rf"%{re.escape(name)} = (\S+) \w[\w-]*\(.*?op_name=\"([^\"]*)\"", hlo_text)
    return f"{match.group(1)} from {match.group(2)[-70:]}" if match else ""


def report(label: str, run, compiled, out_dir, top: int = 12) -> dict:
    """Print the kinds and the ``top`` ops of one traced step; return both as plain dicts."""
    per_op, per_kind = profile_step(run, out_dir)
    text = compiled.as_text()
    (pathlib.Path(out_dir) / "hlo.txt").write_text(text)  # names in the trace -> shapes, JAX ops
    total = sum(per_kind.values()) or 1.0
    print(f"profile {label}: {total:.0f} ms of op time")
    for kind, ms in per_kind.most_common(8):
        print(f"  {ms:8.1f} ms {ms / total:6.1%}  {kind}")
    for name, ms in per_op.most_common(top):
        print(f"  {ms:8.1f} ms  {name}  {describe(text, name)}")
    return {"kinds_ms": dict(per_kind.most_common(8)), "top_ms": dict(per_op.most_common(top))}
