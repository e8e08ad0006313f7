"""Meta-World's own environments, built as LeRobot builds them: the import adapted to this MuJoCo
(the weld width), headless OpenGL, one task's environment reset from a seed and rendered upright, and
the ``View`` a run shows its policy (frame size, render style, window, camera, prompts), which every
environment made for the run takes."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings

import numpy as np

from embodied_jax.sim.metaworld.suite import (
    CAMERA,
    CAMERA_POS,
    INSTALL,
    INSTRUCTIONS,
    MT1_SEED,
    PROMPTS,
    VERSION,
    MetaWorldError,
    prompt,
)

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


RENDER_STYLES = ("fast", "lerobot")


def check_crop(crop) -> tuple[float, float, float] | None:
    """``(top, left, size)`` as fractions of the frame, the window inside it; or None."""
    if crop is None:
        return None
    try:
        top, left, size = (float(x) for x in crop)
    except (TypeError, ValueError) as exc:
        raise MetaWorldError(f"crop={crop!r}: (top, left, size), fractions of the frame") from exc
    if not (0 < size <= 1 and 0 <= top <= 1 - size and 0 <= left <= 1 - size):
        raise MetaWorldError(f"crop={crop!r}: 0 < size <= 1 and the window inside the frame (top, left <= 1 - size)")
    return top, left, size


def check_camera_pos(camera_pos) -> tuple[float, float, float] | None:
    """``corner2``'s position (x, y, z) in metres, finite; or None (LeRobot's, :data:`CAMERA_POS`)."""
    if camera_pos is None:
        return None
    try:
        pos = tuple(float(x) for x in camera_pos)
    except (TypeError, ValueError) as exc:
        raise MetaWorldError(f"camera_pos={camera_pos!r}: (x, y, z) in metres") from exc
    if len(pos) != 3 or not all(np.isfinite(pos)):
        raise MetaWorldError(f"camera_pos={camera_pos!r}: three finite coordinates (x, y, z) in metres")
    return pos


@dataclasses.dataclass(frozen=True)
class View:
    """What a policy is shown of a Meta-World task: the frame's size (height, width), how it is
    rendered (``render_style``, a ``crop`` window, ``corner2``'s ``camera_pos``) and the prompts'
    wording; checked when made. A run's view travels as one value to every environment made for it
    (collection, evaluation, RL rollouts), so that each shows the policy what it trained on.
    The fields are :class:`MetaWorldEnv`'s."""

    image_size: tuple[int, int] = (64, 64)
    prompts: str = "lerobot"
    render_style: str = "fast"
    crop: tuple[float, float, float] | None = None
    camera_pos: tuple[float, float, float] | None = None

    def __post_init__(self):
        try:
            size = tuple(int(x) for x in self.image_size)
        except (TypeError, ValueError) as exc:
            raise MetaWorldError(f"image_size={self.image_size!r}: (height, width), both >= 1") from exc
        if len(size) != 2 or min(size) < 1:
            raise MetaWorldError(f"image_size={self.image_size!r}: (height, width), both >= 1")
        if self.render_style not in RENDER_STYLES:
            raise MetaWorldError(f"render_style={self.render_style!r}: one of {', '.join(RENDER_STYLES)}")
        if self.prompts not in PROMPTS:
            raise MetaWorldError(f"prompts={self.prompts!r}: one of {', '.join(PROMPTS)}")
        object.__setattr__(self, "image_size", size)
        object.__setattr__(self, "crop", check_crop(self.crop))
        object.__setattr__(self, "camera_pos", check_camera_pos(self.camera_pos))

    def env(self, task: str) -> MetaWorldEnv:
        """``task``'s environment showing this view."""
        return MetaWorldEnv(task, **dataclasses.asdict(self))


@functools.cache
def lerobot_task(task: str):
    """``(train class, train_tasks[0])`` of ``MT1(task, seed=42)``: what LeRobot builds each environment from."""
    metaworld = adapt()
    benchmark = metaworld.MT1(f"{task}-v3", seed=MT1_SEED)
    return benchmark.train_classes[f"{task}-v3"], benchmark.train_tasks[0]


class MetaWorldEnv:
    """One Meta-World task built as LeRobot builds it, reset from a seed, rendering ``corner2``
    upright at ``image_size``; ``expert_action`` is Meta-World's scripted policy.

    LeRobot's construction: ``MT1(task, seed=42)``'s train class with ``set_task(train_tasks[0])``,
    ``corner2`` moved to :data:`CAMERA_POS` before the first reset, then randomised resets
    (``_freeze_rand_vec = False``, seeded). ``render_style``: ``"lerobot"`` renders as Meta-World's
    own renderer does (shadows, reflections, skybox; at 480x480 pixel for pixel LeRobot's frame),
    ``"fast"`` with those three off (the same camera, about 3-5x cheaper on a CPU).
    ``prompts``: ``"lerobot"`` (LeRobot's task descriptions) or ``"project"`` (the project's own).
    ``crop``: ``(top, left, size)``, fractions of LeRobot's (square) frame: the frame is rendered at
    ``image_size / size`` and that window of it returned at ``image_size`` (the same camera, a
    zoomed view of the workspace; None, the default: the whole frame, as LeRobot's).
    ``camera_pos``: where ``corner2`` is moved instead of LeRobot's :data:`CAMERA_POS` (its
    orientation unchanged; Meta-World's own pose is :data:`METAWORLD_CAMERA_POS`), to measure the
    camera as a lever; None, the default: LeRobot's."""

    def __init__(
        self,
        task: str,
        image_size: tuple[int, int] = (64, 64),
        *,
        prompts: str = "lerobot",
        render_style: str = "fast",
        crop: tuple[float, float, float] | None = None,
        camera_pos: tuple[float, float, float] | None = None,
    ):
        from metaworld.policies import ENV_POLICY_MAP

        if task not in INSTRUCTIONS:
            raise MetaWorldError(f"unknown Meta-World task {task!r}")
        self.task = task
        self.view = View(image_size, prompts, render_style, crop, camera_pos)
        self.instruction = prompt(task, prompts)
        env_class, first_task = lerobot_task(task)
        env = env_class(render_mode="rgb_array", camera_name=CAMERA)
        env.set_task(first_task)
        import mujoco

        env.model.cam_pos[mujoco.mj_name2id(env.model, mujoco.mjtObj.mjOBJ_CAMERA, CAMERA)] = (
            self.camera_pos or CAMERA_POS
        )
        env.reset()
        env._freeze_rand_vec = False  # draw the object and goal positions at every reset...
        env.seeded_rand_vec = True  # ...from the generator that reset's seed sets
        self._env = env
        self._expert = ENV_POLICY_MAP[f"{task}-v3"]()
        self._renderer = None
        self.obs: np.ndarray | None = None
        self.reward = 0.0

    @property
    def image_size(self) -> tuple[int, int]:
        return self.view.image_size

    @property
    def render_style(self) -> str:
        return self.view.render_style

    @property
    def crop(self) -> tuple[float, float, float] | None:
        return self.view.crop

    @property
    def camera_pos(self) -> tuple[float, float, float] | None:
        return self.view.camera_pos

    @property
    def max_path_length(self) -> int:
        return int(self._env.max_path_length)

    def reset(self, seed: int) -> np.ndarray:
        self._env.seed(int(seed))
        self.obs, _ = self._env.reset(seed=int(seed))
        self.reward = 0.0
        return self.obs

    def step(self, action: np.ndarray) -> bool:
        """Execute one action (clipped to [-1, 1]); True on success (``info["success"]``)."""
        action = np.clip(np.asarray(action, np.float64), -1.0, 1.0)
        self.obs, reward, _, _, info = self._env.step(action)
        self.reward = float(reward)
        return bool(info["success"])

    def state(self) -> np.ndarray:
        """float32 [4]: end-effector position and gripper opening (the policy's proprioception)."""
        return np.asarray(self.obs[:4], np.float32)

    def environment_state(self) -> np.ndarray:
        """float32 [39]: Meta-World's whole observation (hand, objects, goal; LeRobot's
        ``observation.environment_state``). Privileged: datasets keep it, policies never see it."""
        return np.asarray(self.obs, np.float32)

    def expert_action(self) -> np.ndarray:
        with warnings.catch_warnings():  # its gains exceed [-1, 1] by design; actions are clipped on execution
            warnings.filterwarnings("ignore", message="Constant.*too high")
            return np.asarray(self._expert.get_action(self.obs), np.float32)

    def render(self) -> np.ndarray:
        """uint8 [H, W, 3]: ``corner2``, flipped on both axes as LeRobot does (MuJoCo renders it upside down)."""
        import mujoco

        if self._renderer is None:
            check_gl()
            height, width = self._render_size()
            self._env.model.vis.global_.offwidth = max(self._env.model.vis.global_.offwidth, width)
            self._env.model.vis.global_.offheight = max(self._env.model.vis.global_.offheight, height)
            self._renderer = mujoco.Renderer(self._env.model, height, width)
        renderer = self._renderer
        renderer.update_scene(self._env.data, camera=CAMERA)
        if self.render_style == "fast":
            for flag in (
                mujoco.mjtRndFlag.mjRND_SHADOW,
                mujoco.mjtRndFlag.mjRND_REFLECTION,
                mujoco.mjtRndFlag.mjRND_SKYBOX,
            ):
                renderer.scene.flags[flag] = 0
        frame = renderer.render()[::-1, ::-1]
        if self.crop is not None:
            top, left = (round(f * n) for f, n in zip(self.crop[:2], frame.shape[:2], strict=True))
            frame = frame[top : top + self.image_size[0], left : left + self.image_size[1]]
        return np.ascontiguousarray(frame)

    def _render_size(self) -> tuple[int, int]:
        if self.crop is None:
            return self.image_size
        return tuple(round(n / self.crop[2]) for n in self.image_size)

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        self._env.close()
