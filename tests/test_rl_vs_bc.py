"""rl_vs_bc's command line: every ``--rl-flags`` given reaches the RL arm, in order."""

from __future__ import annotations

from embodied_jax.cli import parse_flags
from experiments.benchmarks import rl_vs_bc


def test_each_rl_flags_use_is_kept_in_order():
    flags = parse_flags(
        rl_vs_bc.Flags,
        args=["runs/x", "--rl-flags=--rl.ppo.objective=self_imitation", "--rl-flags=--rl.demo-batch=32"],
    )
    assert flags.rl_flags == ("--rl.ppo.objective=self_imitation", "--rl.demo-batch=32")
    assert parse_flags(rl_vs_bc.Flags, args=["runs/x"]).rl_flags == ()
