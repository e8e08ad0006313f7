"""``--dry-run``: parameter counts and per-device bytes from sharded shapes, nothing allocated."""

from __future__ import annotations

import re
import subprocess
import sys

from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train import loop
from embodied_jax.train.dry_run import report
from tests.train_utils import toy_config


def toy_parameter_count(width, hidden, depth, state_dim=8, action_dim=4, horizon=8):
    flat = horizon * action_dim
    return (
        (flat + state_dim) * width
        + width
        + 2 * (width * width + width)
        + depth * (2 * width * hidden + hidden + width)
        + width * flat
        + flat
    )


def test_dry_run_of_a_billion_parameter_model_shards_and_allocates_nothing(repo_root, subprocess_env):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "toy_large", "--dry-run", "--mesh.data", "1", "--mesh.fsdp", "8"],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo_root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    count = int(re.search(r"^parameters: (\d+)$", out, re.M).group(1))
    assert count == toy_parameter_count(4096, 16384, 8) > 1_000_000_000
    m = re.search(r"bytes per device: parameters (\d+) .*optimizer state (\d+)", out)
    param_bytes, opt_bytes = int(m.group(1)), int(m.group(2))
    total_bytes = int(re.search(r"bytes in total \(all devices\): (\d+)", out).group(1))
    assert total_bytes >= 3 * 4 * count  # float32 parameters plus two Adam moments
    assert param_bytes + opt_bytes <= 1.05 * total_bytes / 8
    peak = int(re.search(r"peak host memory: (\d+)", out).group(1))
    assert peak < 4 * count / 2  # far below the float32 parameters alone (4.3 GB)
    assert "mesh: data=1 × fsdp=8 × tensor=1 over 8 cpu device(s)" in out


def test_dry_run_compile_reports_xla_memory(tmp_path):
    lines = []
    result = report(
        loop.build(toy_config(tmp_path, mesh=MeshConfig(data=1, fsdp=8))),
        compile=True,
        out=lines.append,
        gpu_memory_gb=1.0,
    )
    assert result["parameters"] == toy_parameter_count(64, 128, 2)
    assert result["backend"] == "cpu"
    assert any(
        re.match(r"XLA memory analysis \(cpu, per device\): argument_size=.*temp_size=[\d.]+ GiB", line)
        for line in lines
    )
    assert result["memory_analysis"]["argument_size_in_bytes"] > 0
    assert any(line.startswith("largest buffers live at the memory peak") for line in lines)
    assert result["collectives"]["all-gather"]["count"] > 0  # fsdp=8: parameters are gathered
    assert result["analytic_collective_bytes_per_device"] > 0 and result["flops_per_device"] > 0
    plan = result["memory_plan"]
    assert plan["bytes_per_example"] > 0 and plan["max_examples_per_device"] > 0 and plan["devices_needed"] >= 1
    assert any(line.startswith("memory plan for 1 GB GPUs") for line in lines)
    assert lines[-1].startswith("dry-run summary: {")
    assert not tmp_path.joinpath("checkpoints").exists()
