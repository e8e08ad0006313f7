"""Meta-World, an external suite: its own environments and scripted policies, the project's data and reports.

Meta-World (Farama ``metaworld`` 3.1.1, MIT) is 50 tabletop tasks of one Sawyer arm, each with a
scripted policy in the package. This module runs them unchanged, on CPU MuJoCo:

* tasks are named ``metaworld:<task>`` (Meta-World's name without ``-v3``), several comma-separated,
  or a suite: ``metaworld:mt10``, ``metaworld:mt50``, or a difficulty group ``metaworld:easy|medium|
  hard|very_hard`` (:data:`DIFFICULTY`, the grouping LeRobot reports);
* the observation is LeRobot's Meta-World layout: ``observation.image`` from the ``corner2`` camera
  (rotated upright), ``observation.state`` the 4-D end-effector position and gripper opening, and
  the 4-D ``action`` in [-1, 1] (end-effector delta and gripper); the prompt is a sentence the
  project wrote per task (:data:`INSTRUCTIONS`);
* an episode ends at its first success or after :data:`STEP_LIMIT` steps, the same for collection
  and evaluation; episode ``i`` of a run with seed ``s`` starts from Meta-World's own randomisation
  seeded with :func:`episode_seed` (``s``, task, ``i``), so collection (seed 0 by default) and
  evaluation (seed 1) never share an initial state and either reproduces from its seed.

Installing: ``metaworld`` 3.1.1 pins ``mujoco==3.3.0``; it is installed without its dependencies
(``pip install --no-deps metaworld==3.1.1``; gymnasium, imageio and scipy come from
requirements-dev.txt). Under mujoco 3.17 each weld constraint holds 12 ``eq_data`` values where
Meta-World's ``reset_mocap_welds`` writes 11: :func:`adapt` patches that method to write the same
11 into the first 11 slots, and refuses (:class:`MetaWorldError`) if the installed Meta-World no
longer matches what it adapts. Rendering is headless OpenGL through MuJoCo (``MUJOCO_GL=egl`` by
default, Debian's ``libegl1``/``libegl-mesa0``; ``osmesa`` with ``libosmesa6``), with shadows,
reflections and skybox off (about 30 ms a 64 px frame on a 2-core CPU, against 170-230 ms with
Meta-World's defaults).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import pathlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from embodied_jax.errors import InputError

PREFIX = "metaworld:"
VERSION = "3.1.1"
CAMERA = "corner2"
IMAGE_KEY = "observation.image"
STATE_KEY = "observation.state"
ACTION_KEY = "action"
STEP_LIMIT = 200  # steps per episode (Meta-World's own is 500; its scripted policies finish in 50-160)
FPS = 80  # Meta-World's control rate: 5 physics substeps of 2.5 ms
ROBOT_TYPE = "sawyer"
INSTALL = f"pip install --no-deps metaworld=={VERSION} && pip install gymnasium imageio scipy"

MT10 = (
    "reach",
    "push",
    "pick-place",
    "door-open",
    "drawer-open",
    "drawer-close",
    "button-press-topdown",
    "peg-insert-side",
    "window-open",
    "window-close",
)

# One English sentence per task naming its goal, written for this project.
INSTRUCTIONS = {
    "assembly": "put the ring of the nut over the peg",
    "basketball": "put the ball into the basketball hoop",
    "bin-picking": "move the small box from the red bin into the blue bin",
    "box-close": "put the lid on the box",
    "button-press-topdown": "press the button down from above",
    "button-press-topdown-wall": "reach over the wall and press the button down from above",
    "button-press": "push the button in from the front",
    "button-press-wall": "reach past the wall and push the button in",
    "coffee-button": "press the button of the coffee machine",
    "coffee-pull": "pull the mug out from under the coffee machine",
    "coffee-push": "push the mug under the coffee machine",
    "dial-turn": "turn the dial half a turn",
    "disassemble": "lift the nut off the peg",
    "door-close": "swing the door shut",
    "door-lock": "turn the door's lock down to lock it",
    "door-open": "pull the door open",
    "door-unlock": "turn the door's lock up to unlock it",
    "hand-insert": "put the gripper into the hole in the table",
    "drawer-close": "push the drawer shut",
    "drawer-open": "pull the drawer open",
    "faucet-open": "turn the faucet handle to the left",
    "faucet-close": "turn the faucet handle to the right",
    "hammer": "hit the nail into the wall with the hammer",
    "handle-press-side": "push the handle down from the side",
    "handle-press": "push the handle down",
    "handle-pull-side": "pull the handle up from the side",
    "handle-pull": "pull the handle up",
    "lever-pull": "pull the lever up",
    "peg-insert-side": "slide the peg sideways into the hole",
    "pick-place-wall": "pick up the puck, lift it over the wall and put it on the target",
    "pick-out-of-hole": "lift the puck out of the hole",
    "reach": "move the gripper to the target",
    "push-back": "push the puck backwards to the target",
    "push": "push the puck to the target",
    "pick-place": "pick up the puck and put it on the target",
    "plate-slide": "slide the plate into the goal",
    "plate-slide-side": "slide the plate sideways into the goal",
    "plate-slide-back": "slide the plate back out of the goal",
    "plate-slide-back-side": "slide the plate sideways out of the goal",
    "peg-unplug-side": "pull the peg out of the hole sideways",
    "soccer": "kick the ball into the goal",
    "stick-push": "grab the stick and push the box with it",
    "stick-pull": "grab the stick and pull the box with it",
    "push-wall": "push the puck around the wall to the target",
    "reach-wall": "reach over the wall to the target",
    "shelf-place": "put the puck on the shelf",
    "sweep-into": "sweep the puck into the hole",
    "sweep": "sweep the puck off the table",
    "window-open": "slide the window open",
    "window-close": "slide the window shut",
}

# The difficulty groups LeRobot reports Meta-World by (after Seo et al., 2022).
DIFFICULTY = {
    "easy": (
        "button-press",
        "button-press-topdown",
        "button-press-topdown-wall",
        "button-press-wall",
        "coffee-button",
        "dial-turn",
        "door-close",
        "door-lock",
        "door-open",
        "door-unlock",
        "drawer-close",
        "drawer-open",
        "faucet-close",
        "faucet-open",
        "handle-press",
        "handle-press-side",
        "handle-pull",
        "handle-pull-side",
        "lever-pull",
        "plate-slide",
        "plate-slide-back",
        "plate-slide-back-side",
        "plate-slide-side",
        "reach",
        "reach-wall",
        "window-close",
        "window-open",
        "peg-unplug-side",
    ),
    "medium": (
        "basketball",
        "bin-picking",
        "box-close",
        "coffee-pull",
        "coffee-push",
        "hammer",
        "peg-insert-side",
        "push-wall",
        "soccer",
        "sweep",
        "sweep-into",
    ),
    "hard": ("assembly", "hand-insert", "pick-out-of-hole", "pick-place", "push", "push-back"),
    "very_hard": ("shelf-place", "disassemble", "stick-pull", "stick-push", "pick-place-wall"),
}
MT50 = tuple(sorted(INSTRUCTIONS))
SUITES = {"mt10": MT10, "mt50": MT50, **DIFFICULTY}

# DART noise candidates (std, in action units: 1 = 1 cm of end-effector motion per step).
NOISE_LEVELS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
DART_TARGET = 0.9
CALIBRATION_EPISODES = 50


class MetaWorldError(InputError, ValueError):
    """Meta-World missing, a task it does not have, or an installed version this adapter does not fit."""


def difficulty(task: str) -> str:
    return next(group for group, tasks in DIFFICULTY.items() if task in tasks)


def parse_tasks(spec: str) -> tuple[str, ...]:
    """``metaworld:pick-place,reach`` / ``metaworld:mt10`` -> Meta-World task names (no ``-v3``)."""
    if not spec.startswith(PREFIX) or not spec[len(PREFIX) :]:
        raise MetaWorldError(f"{spec!r}: expected {PREFIX}<task>[,<task>...] or {PREFIX}<{'|'.join(SUITES)}>")
    names: list[str] = []
    for part in spec[len(PREFIX) :].split(","):
        part = part.strip().lower()
        part = part[: -len("-v3")] if part.endswith("-v3") else part
        if part in SUITES:
            names.extend(SUITES[part])
        elif part in INSTRUCTIONS:
            names.append(part)
        else:
            raise MetaWorldError(
                f"unknown Meta-World task {part!r}: one of the 50 tasks ({', '.join(MT50[:4])}, ...) "
                f"or a suite ({', '.join(SUITES)})"
            )
    return tuple(dict.fromkeys(names))


def is_metaworld(task: str) -> bool:
    return task.startswith(PREFIX)


# ---------------------------------------------------------------------------------- installation
_WELD = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 5.0)  # what Meta-World writes per weld


def _reset_mocap_welds(self) -> None:
    """Meta-World's weld reset for MuJoCo versions whose welds hold more than 11 values: the same
    11 values in the first 11 slots, the rest (the weld's torque scale) left as compiled."""
    import mujoco

    if self.model.nmocap > 0 and self.model.eq_data is not None:
        for i in range(self.model.eq_data.shape[0]):
            if self.model.eq_type[i] == mujoco.mjtEq.mjEQ_WELD:
                self.model.eq_data[i, : len(_WELD)] = _WELD


def check_adaptable(source: str, eq_width: int) -> None:
    """The weld adaptation fits ``reset_mocap_welds``'s ``source`` and MuJoCo's weld width, or refuses."""
    compact = "".join(source.split())
    written = "np.array([" + ",".join(f"{v}" for v in _WELD) + "])"
    if written not in compact:
        raise MetaWorldError(
            "this Meta-World's SawyerMocapBase.reset_mocap_welds no longer writes the 11 weld values "
            "embodied_jax.sim.metaworld adapts (found another body): review the adaptation "
            f"(tested with metaworld=={VERSION})"
        )
    if eq_width < len(_WELD):
        raise MetaWorldError(f"MuJoCo stores {eq_width} values per weld, fewer than Meta-World's {len(_WELD)}")


@functools.lru_cache(maxsize=1)
def adapt():
    """Import Meta-World (clear error if missing), adapted to the installed MuJoCo; returns the module."""
    try:
        import metaworld
        import metaworld.sawyer_xyz_env as sawyer
    except ImportError as exc:
        raise MetaWorldError(f"Meta-World is not installed ({exc}): {INSTALL}") from exc
    import mujoco

    base = sawyer.SawyerMocapBase
    current = base.reset_mocap_welds
    if current is not _reset_mocap_welds:
        _ADAPTED_FROM[:] = [current]
        source = inspect.getsource(current)
        width = mujoco.MjModel.from_xml_string(_WELD_PROBE).eq_data.shape[1]
        check_adaptable(source, width)
        if width != len(_WELD):
            base.reset_mocap_welds = _reset_mocap_welds
    return metaworld


_ADAPTED_FROM: list = []


def adapted_from():
    """Meta-World's own ``reset_mocap_welds`` as installed (before :func:`adapt` replaced it)."""
    adapt()
    return _ADAPTED_FROM[0]


_WELD_PROBE = """<mujoco><worldbody><body name="a" mocap="true"/><body name="b"><freejoint/>
<geom size=".1"/></body></worldbody><equality><weld body1="a" body2="b"/></equality></mujoco>"""


GL_PACKAGES = {"egl": "libegl1 libegl-mesa0", "osmesa": "libosmesa6"}


@functools.lru_cache(maxsize=1)
def check_gl() -> str:
    """Select a headless OpenGL backend for MuJoCo's renderer and make one context with it; returns
    the backend, or raises one clear error naming the package to install.

    ``MUJOCO_GL`` wins when set; otherwise EGL without a display (MuJoCo chose its backend when it
    was imported, before this module could set the variable, so the choice is made here)."""
    import importlib

    import mujoco
    from mujoco.rendering.classic import gl_context

    backend = os.environ.get("MUJOCO_GL", "").lower() or ("glfw" if os.environ.get("DISPLAY") else "egl")
    package = GL_PACKAGES.get(backend, GL_PACKAGES["egl"])
    try:
        if backend in GL_PACKAGES:
            os.environ.setdefault("MUJOCO_GL", backend)
            gl_context.GLContext = importlib.import_module(f"mujoco.{backend}").GLContext
        context = gl_context.GLContext(8, 8)
        context.free()
    except (ImportError, OSError, RuntimeError, AttributeError, mujoco.FatalError) as exc:  # the GL loaders' kinds
        raise MetaWorldError(
            f"no headless OpenGL for MUJOCO_GL={backend} ({type(exc).__name__}: {exc}): "
            f"apt-get install -y {package} (or set MUJOCO_GL=egl|osmesa)"
        ) from exc
    return backend


# ---------------------------------------------------------------------------------- environment
def episode_seed(seed: int, task: str, episode: int) -> int:
    """The reset seed of ``episode`` of ``task`` in a run seeded ``seed``."""
    index = MT50.index(task)
    return int(np.random.SeedSequence([seed, index, episode]).generate_state(1)[0])


class MetaWorldEnv:
    """One Meta-World task in its own (goal-observable) environment, reset from a seed, rendering
    ``corner2`` upright at ``image_size``; ``expert_action`` is Meta-World's scripted policy."""

    def __init__(self, task: str, image_size: tuple[int, int] = (64, 64)):
        metaworld = adapt()
        from metaworld.policies import ENV_POLICY_MAP

        if task not in INSTRUCTIONS:
            raise MetaWorldError(f"unknown Meta-World task {task!r}")
        self.task, self.image_size = task, tuple(int(x) for x in image_size)
        self.instruction = INSTRUCTIONS[task]
        self._env = metaworld.ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[f"{task}-v3-goal-observable"]()
        self._expert = ENV_POLICY_MAP[f"{task}-v3"]()
        self._renderer = None
        self.obs: np.ndarray | None = None

    def reset(self, seed: int) -> np.ndarray:
        env = self._env
        env._freeze_rand_vec = False  # draw the object and goal positions from the seeded generator
        env.seeded_rand_vec = True
        env.seed(int(seed))
        self.obs, _ = env.reset()
        return self.obs

    def step(self, action: np.ndarray) -> bool:
        """Execute one action (clipped to [-1, 1]); True on success."""
        action = np.clip(np.asarray(action, np.float64), -1.0, 1.0)
        self.obs, _, _, _, info = self._env.step(action)
        return bool(info["success"])

    def state(self) -> np.ndarray:
        """float32 [4]: end-effector position and gripper opening (the policy's proprioception)."""
        return np.asarray(self.obs[:4], np.float32)

    def expert_action(self) -> np.ndarray:
        with warnings.catch_warnings():  # its gains exceed [-1, 1] by design; actions are clipped on execution
            warnings.filterwarnings("ignore", message="Constant.*too high")
            return np.asarray(self._expert.get_action(self.obs), np.float32)

    def render(self) -> np.ndarray:
        """uint8 [H, W, 3]: ``corner2``, upright (MuJoCo renders it upside down)."""
        import mujoco

        if self._renderer is None:
            check_gl()
            height, width = self.image_size
            self._env.model.vis.global_.offwidth = max(self._env.model.vis.global_.offwidth, width)
            self._env.model.vis.global_.offheight = max(self._env.model.vis.global_.offheight, height)
            self._renderer = mujoco.Renderer(self._env.model, height, width)
        renderer = self._renderer
        renderer.update_scene(self._env.data, camera=CAMERA)
        for flag in (
            mujoco.mjtRndFlag.mjRND_SHADOW,
            mujoco.mjtRndFlag.mjRND_REFLECTION,
            mujoco.mjtRndFlag.mjRND_SKYBOX,
        ):
            renderer.scene.flags[flag] = 0
        return np.ascontiguousarray(renderer.render()[::-1, ::-1])

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        self._env.close()


# ---------------------------------------------------------------------------------- collection
@dataclasses.dataclass
class ExpertResult:
    success: bool
    length: int
    episode: dict[str, Any] | None  # recorded frames (None when not recording)


def expert_episode(
    env: MetaWorldEnv, seed: int, *, noise: float = 0.0, record: bool = True, limit: int = STEP_LIMIT
) -> ExpertResult:
    """Meta-World's scripted policy for one episode. ``noise``: std of Gaussian noise on the
    executed end-effector delta (DART; the recorded action stays the expert's). Frame t holds
    the observation before action t; the episode ends with the action that succeeded."""
    env.reset(seed)
    rng = np.random.default_rng(seed)
    states, actions, frames = [], [], []
    success, length = False, 0
    while length < limit and not success:
        action = env.expert_action()
        if record:
            states.append(env.state())
            actions.append(action)
            frames.append(env.render())
        executed = action.copy()
        if noise:
            executed[:3] += noise * rng.standard_normal(3)
        success = env.step(executed)
        length += 1
    episode = None
    if record:
        episode = {
            "task": env.instruction,
            STATE_KEY: np.stack(states),
            ACTION_KEY: np.clip(np.stack(actions), -1.0, 1.0).astype(np.float32),
            IMAGE_KEY: np.stack(frames),
        }
    return ExpertResult(success, length, episode)


def calibrate_noise(
    task: str,
    *,
    target: float = DART_TARGET,
    levels: Sequence[float] = NOISE_LEVELS,
    episodes: int = CALIBRATION_EPISODES,
    seed: int = 0,
) -> tuple[float, dict[float, float]]:
    """The largest of ``levels`` (ascending; stops at the first miss) at which the noisy scripted
    policy succeeds in at least ``target`` of ``episodes`` (no rendering), 0.0 if none; and the
    success rate measured at each level tried (seeds apart from collection's and evaluation's)."""
    env = MetaWorldEnv(task)
    chosen, measured = 0.0, {}
    try:
        for level in sorted(levels):
            wins = sum(
                expert_episode(env, episode_seed(seed + 1000, task, i), noise=level, record=False).success
                for i in range(episodes)
            )
            measured[level] = wins / episodes
            if measured[level] < target:
                break
            chosen = level
    finally:
        env.close()
    return chosen, measured


def collect(
    tasks: str | Sequence[str],
    episodes: int,
    out: str | os.PathLike,
    *,
    image_size: tuple[int, int] = (64, 64),
    seed: int = 0,
    noise: float | None = None,
    keep_failures: bool = False,
    max_attempts: int | None = None,
    image_storage: str = "png",
    codec: str = "h264",
    max_steps: int = STEP_LIMIT,
    log: Callable[[str], None] = print,
) -> pathlib.Path:
    """``episodes`` scripted demonstrations per task written as one LeRobot v3.0 dataset.

    ``noise``: DART std in action units for every task; None: calibrated per task
    (:func:`calibrate_noise`, printed). Episode ``i`` of a task resets with
    ``episode_seed(seed, task, i)``; failed episodes are skipped (unless ``keep_failures``) and
    the next seed tried, at most ``max_attempts`` (default 2 x episodes + 10) per task. Frames are
    lossless PNG by default (``image_storage="video"``: mp4 in ``codec``). ``max_steps``: the
    episode's step limit (:data:`STEP_LIMIT`, the evaluation's; lower only for quick checks)."""
    from embodied_jax.data.writer import write_lerobot_dataset

    names = parse_tasks(tasks) if isinstance(tasks, str) else tuple(tasks)
    if episodes < 1 or max_steps < 1:
        raise ValueError(f"episodes ({episodes}) and max_steps ({max_steps}) must be >= 1")
    check_gl()
    if noise is not None and not (np.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise={noise}: a finite std in action units, >= 0")
    recorded: list[dict] = []
    for task in names:
        level = noise
        if level is None:
            level, measured = calibrate_noise(task, seed=seed)
            table = ", ".join(f"{k:g}: {v:.0%}" for k, v in measured.items())
            log(f"metaworld:{task}: scripted success by DART noise ({CALIBRATION_EPISODES} episodes each): {table}")
        env = MetaWorldEnv(task, image_size)
        kept, attempts, wins = 0, 0, 0
        limit = max_attempts or 2 * episodes + 10
        try:
            while kept < episodes and attempts < limit:
                result = expert_episode(env, episode_seed(seed, task, attempts), noise=level, limit=max_steps)
                attempts += 1
                wins += result.success
                if result.success or keep_failures:
                    recorded.append(result.episode)
                    kept += 1
        finally:
            env.close()
        log(
            f"metaworld:{task}: scripted policy succeeded in {wins} of {attempts} episodes ({wins / attempts:.1%}) "
            f"at DART noise {level:g}"
        )
        if kept < episodes:
            raise RuntimeError(f"metaworld:{task}: only {kept} successful episodes in {attempts} attempts")
    return write_lerobot_dataset(out, recorded, fps=FPS, version="v3.0", image_storage="png", robot_type=ROBOT_TYPE)


# ---------------------------------------------------------------------------------- evaluation
# A policy: a raw observation batch in dataset keys ({"observation.state": [B, 4], "observation.image":
# [B, H, W, 3], "task": [B] str}) and a seed -> actions [B, horizon, 4] (what PolicyBundle.predict takes).
BatchPolicy = Callable[[Mapping[str, Any], int], np.ndarray]


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    episodes: int = 10  # per task
    envs: int = 10  # environments stepped together: one policy call per decision for all of them
    execute_steps: int = 4  # actions executed from each chunk before the next decision
    seed: int = 1
    videos: int = 1  # first episodes per task written as mp4 (decision frames)
    limit: int = STEP_LIMIT


def evaluate(
    policy: BatchPolicy,
    tasks: str | Sequence[str],
    settings: EvalSettings = EvalSettings(),
    *,
    image_size: tuple[int, int] = (64, 64),
    out_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Closed-loop success of ``policy`` per task, per difficulty group and overall (95% Wilson
    intervals); with ``out_dir``: per-task videos of the first episodes and a frame grid."""
    from embodied_jax.sim import media
    from embodied_jax.sim.evaluate import wilson_interval

    names = parse_tasks(tasks) if isinstance(tasks, str) else tuple(tasks)
    if settings.episodes < 1 or settings.envs < 1 or settings.execute_steps < 1:
        raise ValueError(f"{settings}: episodes, envs and execute_steps must be >= 1")
    check_gl()
    out = None if out_dir is None else pathlib.Path(out_dir)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    per_task: dict[str, dict[str, Any]] = {}
    grid_rows = []
    for t, task in enumerate(names):
        successes, lengths, videos = _evaluate_task(
            policy, task, settings, image_size, call_seed=settings.seed * 7919 + t
        )
        wins = int(np.sum(successes))
        low, high = wilson_interval(wins, len(successes))
        entry = {
            "success_rate": wins / len(successes),
            "success_ci95": [low, high],
            "episodes": len(successes),
            "mean_episode_length": float(np.mean(lengths)),
            "difficulty": difficulty(task),
        }
        if out is not None and videos:
            entry["videos"] = [
                str(media.write_mp4(out / f"{task}_episode{i}.mp4", video, fps=max(1, FPS // settings.execute_steps)))
                for i, video in enumerate(videos)
            ]
            picks = np.linspace(0, len(videos[0]) - 1, 8).round().astype(int)
            grid_rows.append(videos[0][picks])
        per_task[task] = entry
    groups = {}
    for group, members in DIFFICULTY.items():
        present = [per_task[m] for m in members if m in per_task]
        if present:
            wins = sum(round(e["success_rate"] * e["episodes"]) for e in present)
            total = sum(e["episodes"] for e in present)
            groups[group] = {
                "success_rate": wins / total,
                "success_ci95": list(wilson_interval(wins, total)),
                "episodes": total,
            }
    wins = sum(round(e["success_rate"] * e["episodes"]) for e in per_task.values())
    total = sum(e["episodes"] for e in per_task.values())
    metrics = {
        "task": PREFIX + ",".join(names),
        "success_rate": wins / total,
        "success_ci95": list(wilson_interval(wins, total)),
        "mean_task_success": float(np.mean([e["success_rate"] for e in per_task.values()])),
        "episodes": total,
        "mean_episode_length": float(np.mean([e["mean_episode_length"] for e in per_task.values()])),
        "per_task": per_task,
        "per_difficulty": groups,
        "settings": dataclasses.asdict(settings),
        "image_size": list(image_size),
        "videos": [v for e in per_task.values() for v in e.get("videos", [])],
    }
    if out is not None and grid_rows:
        metrics["frame_grid"] = str(
            media.write_png(out / "metaworld_frames.png", media.frame_grid(np.stack(grid_rows)))
        )
    return metrics


def _evaluate_task(policy: BatchPolicy, task: str, settings: EvalSettings, image_size, *, call_seed: int):
    envs = [MetaWorldEnv(task, image_size) for _ in range(min(settings.envs, settings.episodes))]
    successes, lengths, videos = [], [], []
    try:
        for start in range(0, settings.episodes, len(envs)):
            ids = list(range(start, min(start + len(envs), settings.episodes)))
            group = envs[: len(ids)]
            for env, i in zip(group, ids, strict=True):
                env.reset(episode_seed(settings.seed, task, i))
            done = np.zeros(len(group), bool)
            success = np.zeros(len(group), bool)
            length = np.zeros(len(group), int)
            recording = [i < settings.videos for i in ids]
            frames: list[list[np.ndarray]] = [[] for _ in ids]
            last = [None] * len(group)
            decision = 0
            while not done.all():
                for b, env in enumerate(group):
                    if not done[b]:
                        last[b] = (env.state(), env.render())
                        if recording[b]:
                            frames[b].append(last[b][1])
                # Always a batch of `envs` rows (finished or missing rows repeat one), so the policy compiles once.
                rows = [last[b] for b in range(len(group))] + [last[0]] * (len(envs) - len(group))
                batch = {
                    STATE_KEY: np.stack([r[0] for r in rows]),
                    IMAGE_KEY: np.stack([r[1] for r in rows]),
                    "task": [INSTRUCTIONS[task]] * len(rows),
                }
                chunk = np.asarray(policy(batch, call_seed * 100_003 + start * 1009 + decision))
                decision += 1
                if chunk.shape[1] < settings.execute_steps:
                    raise ValueError(f"policy returns {chunk.shape[1]} actions per chunk < execute_steps")
                for b, env in enumerate(group):
                    for j in range(settings.execute_steps):
                        if done[b]:
                            break
                        success[b] = env.step(chunk[b, j])
                        length[b] += 1
                        done[b] = success[b] or length[b] >= settings.limit
            successes += list(success)
            lengths += list(length)
            videos += [np.stack(f) for f, r in zip(frames, recording, strict=True) if r]
    finally:
        for env in envs:
            env.close()
    return successes, lengths, videos
