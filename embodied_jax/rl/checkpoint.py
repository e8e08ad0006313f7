"""An RL run's checkpoints: the policy where any run keeps it, the RL state beside it.

``<workdir>/checkpoints/<iteration>`` is a train checkpoint (``train/checkpoint.py``) of the
starting run's config with the RL weights as its parameters (and EMA), so ``load_policy``,
``embodied_jax.evaluate``, ``export`` and ``serve`` take it unchanged.
``<workdir>/rl_state/<iteration>`` holds the critic, both optimizers' states, the RNG key and
the counters (iteration, environment steps, wall time); with demonstrations (``rl/demos.py``) the
policy's checkpoint also holds their iterator's state. A resume restores the latest iteration
present in both; RNG keys derive from the seed and the iteration, so a resumed run repeats the
uninterrupted one.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from embodied_jax.assets import asset_files
from embodied_jax.config_registry import to_dict
from embodied_jax.train.checkpoint import Checkpointer
from embodied_jax.train.config import CheckpointConfig

RL_STATE = "rl_state"


class RLCheckpointer:
    def __init__(self, workdir: pathlib.Path, keep_last: int):
        workdir = pathlib.Path(workdir).absolute()  # Orbax writes absolute paths only
        self.policy = Checkpointer(workdir / "checkpoints", CheckpointConfig(async_save=False, keep_last=keep_last))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep_last, create=True, enable_async_checkpointing=False)
        self.rl = ocp.CheckpointManager(workdir / RL_STATE, options=options)

    def latest(self) -> int | None:
        """The latest iteration both parts hold."""
        common = set(self.policy.all_steps()) & set(self.rl.all_steps())
        return max(common) if common else None

    def save(self, iteration: int, start, params: Any, rl_state: dict, iterator: Any = None) -> None:
        self.rl.save(iteration, args=ocp.args.StandardSave(rl_state), force=True)
        self.rl.wait_until_finished()
        self.policy.save(
            iteration,
            start.train_state(params),
            iterator=iterator,
            norm_stats=start.norm_stats,
            config=to_dict(start.base),
            assets=asset_files(start.base.model) or None,
            force=True,
        )
        self.policy.wait()
        self.policy.prune()

    def restore(self, iteration: int, start, rl_template: dict, iterator: Any = None) -> tuple[Any, dict]:
        rt = start.rt
        state, _ = self.policy.restore(rt.abstract_state, rt.shardings, step=iteration, iterator=iterator)
        params = state.ema if state.ema is not None else state.params
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rl_template)
        rl_state = self.rl.restore(iteration, args=ocp.args.StandardRestore(target))
        return params, dict(rl_state)

    def close(self) -> None:
        self.policy.close()
        self.rl.close()
