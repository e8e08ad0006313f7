"""Start N CPU processes on localhost that form one JAX cluster.

    python launch/local.py --num-processes 2 --devices-per-process 4 -- toy --train.steps 20

Each process gets ``--xla_force_host_platform_device_count`` virtual CPU devices and the
``--coordinator/--num-processes/--process-id`` flags of the launcher. Output of process 0
is shown; the others go to ``<workdir>/process_<i>.log``. Exits with the first non-zero
status.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--log-dir", default="runs/local_logs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- NAME [--overrides] for experiments.launch")
    opts = parser.parse_args()
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    root = pathlib.Path(__file__).resolve().parents[1]
    log_dir = pathlib.Path(opts.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for pid in range(opts.num_processes):
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={opts.devices_per_process}"
        env["JAX_PLATFORMS"] = "cpu"
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [
            sys.executable,
            "-m",
            "experiments.launch",
            *args,
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            str(opts.num_processes),
            "--process-id",
            str(pid),
        ]
        out = None if pid == 0 else open(log_dir / f"process_{pid}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
