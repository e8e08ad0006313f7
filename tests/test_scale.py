"""Scale by compilation: reduced π0.5 / GR00T-N1.5 compiled for 64 virtual devices shard their
state, keep per-device activations independent of the device count, and move parameters over
the fsdp axis; a tensor-parallel rules override gives the default rules' loss."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.parallel.partition import describe_spec
from embodied_jax.train import loop
from tests import scale_check


@pytest.fixture(scope="module")
def compiled(repo_root, subprocess_env):
    """{devices: {model: dry-run figures}} for 64 (a subprocess) and 8 devices (this process),
    compiled side by side: XLA compiles on one core, and CI has two."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.scale_check", "64"],
        env=subprocess_env,
        cwd=repo_root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        at_8 = scale_check.measure(8)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {64: {row["model"]: row for row in rows}, 8: at_8}


@pytest.mark.parametrize("model", ["pi05", "gr00t_n15"])
def test_reduced_models_shard_on_64_devices(compiled, model):
    big, small = compiled[64][model], compiled[8][model]
    assert big["num_devices"] == 64 and big["fsdp"] == 64
    assert big["fallbacks"] > 0  # axes narrower than, or not divisible by, 64 were placed elsewhere
    state = big["param_bytes_per_device"] + big["opt_bytes_per_device"] + big["ema_bytes_per_device"]
    assert state <= 1.1 * big["total_state_bytes"] / 64
    # Activations follow the per-device batch (1 example), not the device count: temp does not
    # grow with the devices, and what it loses is no more than the state shard it loses
    # (gradient and optimizer buffers shrink as 1/devices).
    assert big["temp_bytes_per_device"] <= 1.1 * small["temp_bytes_per_device"]
    small_state = small["param_bytes_per_device"] + small["opt_bytes_per_device"] + small["ema_bytes_per_device"]
    assert small["temp_bytes_per_device"] - big["temp_bytes_per_device"] <= small_state - state
    kinds, axes = big["collectives"], big["collectives_by_axis"]
    assert kinds["all-gather"]["count"] > 0 and kinds["all-gather"]["bytes"] > 0
    assert kinds["reduce-scatter"]["count"] > 0 and kinds["reduce-scatter"]["bytes"] > 0
    assert axes["fsdp"]["bytes"] >= 0.95 * big["collective_bytes_per_device"]
    # The parameter-tree count of the same traffic agrees with the HLO's.
    assert big["collective_bytes_per_device"] == pytest.approx(big["analytic_collective_bytes_per_device"], rel=0.15)


def test_tensor_parallel_rules_shard_the_vlm_mlp_and_keep_the_loss(tmp_path):
    from experiments.pi05 import tiny_model
    from tests.train_utils import losses

    base = dataclasses.replace(scale_check.experiments()["pi05"], workdir=str(tmp_path / "fsdp"), model=tiny_model())
    base = dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, steps=3, batch_size=8, log_every=1),
        checkpoint=dataclasses.replace(base.checkpoint, enabled=False),
        metrics=dataclasses.replace(base.metrics, progress_bar=False, tensorboard=False),
    )
    tp = dataclasses.replace(
        base, workdir=str(tmp_path / "tp"), mesh=MeshConfig(data=1, fsdp=4, tensor=2, rules=("tensor_parallel",))
    )
    base = dataclasses.replace(base, mesh=MeshConfig(data=1, fsdp=8))
    rt = loop.build(tp)
    mlp = rt.shardings.params["llm"]["layers"]["experts"][0]["mlp"]
    assert describe_spec(mlp["gate_proj"]["kernel"].spec, rt.mesh) == "(None, fsdp, tensor)"
    assert describe_spec(mlp["down_proj"]["kernel"].spec, rt.mesh) == "(None, tensor, fsdp)"
    attn = rt.shardings.params["llm"]["layers"]["experts"][0]["self_attn"]
    assert describe_spec(attn["q_proj"]["kernel"].spec, rt.mesh) == "(None, fsdp, tensor)"
    default = loop.build(base)
    assert "tensor" not in describe_spec(
        default.shardings.params["llm"]["layers"]["experts"][0]["mlp"]["gate_proj"]["kernel"].spec, default.mesh
    )
    with_tp, without = loop.train(tp).history, loop.train(base).history
    assert sorted(losses(with_tp)) == [1, 2, 3]  # step 1 runs at lr 0 (warmup): step 3 sees an update
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([h[key] for h in with_tp], [h[key] for h in without], rtol=2e-5, atol=1e-6)


def test_scale_report_projects_and_ends_with_the_compiled_configuration(capsys):
    from experiments.benchmarks import scale_report

    rows = scale_report.main(["toy", "--devices", "8", "--examples-per-device", "2", "--round-node-hours", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"model"')]
    assert lines == rows and [r["devices"] for r in rows] == [8, 64, 256, 1024, 8]
    last = rows[-1]
    assert last["compiled"] and last["devices"] == 8 and last["fsdp"] == 8 and last["examples_per_device"] == 2
    keys = {
        "model",
        "devices",
        "compiled",
        "param_bytes_per_device",
        "opt_bytes_per_device",
        "temp_bytes_per_device",
        "collective_bytes_per_device",
        "analytic_collective_bytes_per_device",
        "total_state_bytes",
        "fsdp",
        "examples_per_device",
        "fits_h200",
        "projected_step_s",
    }
    assert all(keys <= set(r) for r in rows) and not any(r["compiled"] for r in rows[:-1])
    # More GPUs never hold more state per GPU; a step never beats its compute time.
    states = [r["param_bytes_per_device"] + r["opt_bytes_per_device"] for r in rows[:-1]]
    assert states == sorted(states, reverse=True)
    assert all(r["projected_step_s"] >= r["compute_s"] > 0 for r in rows[:-1])
    # Two nodes' ring: each GPU's 7/8 over NVLink plus each node's half over RDMA.
    assert scale_report.comm_seconds({"all-gather": 1e9}, 16, 8) == pytest.approx(1e9 * (7 / 8 / 900e9 + 1 / 2 / 400e9))
