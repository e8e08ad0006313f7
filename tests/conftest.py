"""Test session setup: an 8-device CPU mesh and a shared JAX compilation cache.

Environment variables are set before JAX is imported so that every test (and every
subprocess a test starts, which inherits the environment) sees 8 virtual CPU devices
and reuses compiled executables from the same on-disk cache.
"""

import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parents[1]

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# Tests compile many small programs and run them briefly: LLVM's optimisation passes cost
# more than they save (about half the compile time of a train step on CI's 2 cores).
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# 8 virtual devices share CI's 2 cores: a device thread can wait long for a collective's
# rendezvous, and XLA aborts the process after 40 s by default.
if "xla_cpu_collective_call_terminate_timeout_seconds" not in _flags:
    _flags += (
        " --xla_cpu_collective_call_terminate_timeout_seconds=900"
        " --xla_cpu_collective_call_warn_stuck_timeout_seconds=300"
        " --xla_cpu_collective_timeout_seconds=900"
    )
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return _ROOT


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the repo importable, same cache and devices."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


DEMO_IMAGE = 32  # as tests/test_sim_collect.py: the expert rollout compiles once for both


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> pathlib.Path:
    """One tiny demo run (collect, 4 training steps, evaluation) shared by every test module
    that needs a trained policy: its run directory."""
    import dataclasses

    from embodied_jax.train.config import CheckpointConfig, MetricsConfig, TrainConfig
    from experiments.demo import demo_config, run_demo

    workdir = tmp_path_factory.mktemp("demo")
    base = demo_config(image_size=DEMO_IMAGE)
    config = dataclasses.replace(
        base,
        episodes=6,
        # The final evaluation is ``evaluate_policy``, which tests/test_evaluate.py runs through
        # its command line: evaluations compile with host callbacks, which are never cached.
        eval_envs=0,
        num_videos=0,
        workdir=str(workdir),
        model=dataclasses.replace(base.model, num_inference_steps=2),  # plumbing, not success: cheap sampling
        train=TrainConfig(steps=4, batch_size=8, log_every=2, eval_every=4),  # in-training eval at the end
        checkpoint=CheckpointConfig(save_every=4, keep_last=1, async_save=False),
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
        evaluation=dataclasses.replace(base.evaluation, num_envs=8, execute_steps=5),
    )
    assert run_demo(config) == 0
    return workdir


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU (run with JAX_PLATFORMS=cuda,cpu); skipped without one")
    config.addinivalue_line(
        "markers",
        "hlo: asserts on the structure of XLA:CPU's compiled output for the pinned JAX version "
        "(docs/performance.md: what to do when JAX is upgraded)",
    )


# Test modules that share the session's ``demo_run``: one xdist worker runs them all, so the
# demo is trained once.
DEMO_RUN_MODULES = {
    "test_demo_e2e.py",
    "test_evaluate.py",
    "test_finetune_tiny.py",
    "test_relocation.py",
    "test_serve.py",
    "test_hostile.py",
    "test_serve_admission.py",
    "test_rl_run.py",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # With ``-n 2 --dist loadgroup`` (README's test command) each module runs on one worker,
    # so its module-scoped fixtures (compiled functions, rollouts) are built once.
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            name = item.path.name
            item.add_marker(pytest.mark.xdist_group("demo_run" if name in DEMO_RUN_MODULES else name))
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (default backend is {jax.default_backend()!r})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
