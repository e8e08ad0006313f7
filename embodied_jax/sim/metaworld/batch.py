"""Meta-World environments of one or more tasks stepped together on the host, for reinforcement
learning (``rl/host_rollout.py``'s ``HostEnvs``): the evaluation's environments (LeRobot's
construction, prompts, 500-step episodes ended by the first success), ``envs_per_task`` of each
task in consecutive rows.

Rows reset from ``episode_seed(RL_SEED, task, i)``, ``i`` drawn from the rollout's key and the
row's index: a stream of start states no collection, calibration, validation or test episode
shares (``sim/seeds.py``). A finished row is not stepped and keeps its last frame.
"""

from __future__ import annotations

import numpy as np

from embodied_jax.sim.metaworld.env import View
from embodied_jax.sim.metaworld.suite import STEP_LIMIT, episode_seed
from embodied_jax.sim.seeds import RL_SEED


class MetaWorldBatch:
    camera = "image"  # the observation's camera name; a run reads it as ``observation.image``

    def __init__(
        self,
        tasks: tuple[str, ...],
        envs_per_task: int,
        view: View | None = None,
        *,
        limit: int = STEP_LIMIT,
    ):
        if envs_per_task < 1:
            raise ValueError(f"envs_per_task={envs_per_task}: at least 1")
        self.tasks = tuple(tasks)
        view = view or View()  # LeRobot's frames at 64 px, LeRobot's prompts
        self.envs = [view.env(task) for task in self.tasks for _ in range(envs_per_task)]
        self.row_task = [task for task in self.tasks for _ in range(envs_per_task)]
        self.instructions = tuple(env.instruction for env in self.envs[::envs_per_task])  # one per task
        self._task_index = np.repeat(np.arange(len(self.tasks), dtype=np.int32), envs_per_task)
        self.num_envs, self.episode_limit = len(self.envs), int(limit)
        if self.episode_limit > self.envs[0].max_path_length:
            raise ValueError(f"limit={limit}: Meta-World ends its episodes at {self.envs[0].max_path_length} steps")
        self.done = np.zeros(self.num_envs, bool)
        self.success = np.zeros(self.num_envs, bool)
        self.steps = np.zeros(self.num_envs, np.int32)
        self._frames: list[np.ndarray | None] = [None] * self.num_envs

    def reset(self, key, env_ids) -> None:
        import jax

        draw = np.random.SeedSequence([int(x) for x in np.asarray(jax.random.key_data(key)).ravel()])
        base = int(draw.generate_state(1)[0])
        for row, (env, i) in enumerate(zip(self.envs, np.asarray(env_ids), strict=True)):
            env.reset(episode_seed(RL_SEED, self.row_task[row], base * 4096 + int(i)))
        self.done[:], self.success[:], self.steps[:] = False, False, 0
        self._frames = [None] * self.num_envs

    def observe(self) -> dict:
        """``{"state": float32 [B, 4], "images": {"image": uint8 [B, H, W, 3]}, "task_index": int32 [B]}``
        (``task_index``: the row's task in ``tasks``, which picks its prompt)."""
        for row, env in enumerate(self.envs):
            if self._frames[row] is None or not self.done[row]:
                self._frames[row] = env.render()
        state = np.stack([env.state() for env in self.envs])
        return {"state": state, "images": {self.camera: np.stack(self._frames)}, "task_index": self._task_index}

    def privileged_state(self) -> np.ndarray:
        """float32 [B, 39]: Meta-World's whole observation (objects' and goal's poses among it)."""
        return np.stack([env.environment_state() for env in self.envs])

    def step(self, actions: np.ndarray) -> np.ndarray:
        reward = np.zeros(self.num_envs, np.float32)
        for row, env in enumerate(self.envs):
            if self.done[row]:
                continue
            self.success[row] = env.step(actions[row])
            reward[row] = env.reward
            self.steps[row] += 1
            self.done[row] = self.success[row] or self.steps[row] >= self.episode_limit
        return reward

    def close(self) -> None:
        for env in self.envs:
            env.close()
