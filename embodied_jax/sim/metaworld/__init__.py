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

from embodied_jax.sim.metaworld.closed_loop import BatchPolicy, EvalSettings, evaluate
from embodied_jax.sim.metaworld.collect import (
    CALIBRATION_EPISODES,
    DART_TARGET,
    NOISE_LEVELS,
    ExpertResult,
    calibrate_noise,
    collect,
    expert_episode,
)
from embodied_jax.sim.metaworld.env import GL_PACKAGES, MetaWorldEnv, adapt, adapted_from, check_adaptable, check_gl
from embodied_jax.sim.metaworld.suite import (
    ACTION_KEY,
    CAMERA,
    DIFFICULTY,
    FPS,
    IMAGE_KEY,
    INSTALL,
    INSTRUCTIONS,
    MT10,
    MT50,
    PREFIX,
    ROBOT_TYPE,
    STATE_KEY,
    STEP_LIMIT,
    SUITES,
    VERSION,
    MetaWorldError,
    difficulty,
    episode_seed,
    is_metaworld,
    parse_tasks,
)

__all__ = [
    "ACTION_KEY",
    "CALIBRATION_EPISODES",
    "CAMERA",
    "DART_TARGET",
    "DIFFICULTY",
    "FPS",
    "GL_PACKAGES",
    "IMAGE_KEY",
    "INSTALL",
    "INSTRUCTIONS",
    "MT10",
    "MT50",
    "NOISE_LEVELS",
    "PREFIX",
    "ROBOT_TYPE",
    "STATE_KEY",
    "STEP_LIMIT",
    "SUITES",
    "VERSION",
    "BatchPolicy",
    "EvalSettings",
    "ExpertResult",
    "MetaWorldEnv",
    "MetaWorldError",
    "adapt",
    "adapted_from",
    "calibrate_noise",
    "check_adaptable",
    "check_gl",
    "collect",
    "difficulty",
    "episode_seed",
    "evaluate",
    "expert_episode",
    "is_metaworld",
    "parse_tasks",
]
