"""Meta-World, an external suite: its own environments and scripted policies, the project's data and reports.

Meta-World (Farama ``metaworld`` 3.1.1, MIT) is 50 tabletop tasks of one Sawyer arm, each with a
scripted policy in the package. This module runs them unchanged, on CPU MuJoCo:

* tasks are named ``metaworld:<task>`` (Meta-World's name without ``-v3``), several comma-separated,
  or a suite: ``metaworld:mt10``, ``metaworld:mt50``, or a difficulty group ``metaworld:easy|medium|
  hard|very_hard`` (:data:`DIFFICULTY`, the grouping LeRobot reports);
* each environment is built as LeRobot builds it (``MT1(task, seed=42)``'s train class,
  ``set_task(train_tasks[0])``, ``corner2`` moved to :data:`CAMERA_POS`, frames flipped on both
  axes, randomised resets); the prompt is LeRobot's task description (:data:`LEROBOT_DESCRIPTIONS`;
  the project's own sentences, :data:`INSTRUCTIONS`, on request);
* datasets have ``lerobot/metaworld_mt50``'s layout: ``observation.image``, ``observation.state``
  (4-D end-effector position and gripper opening), ``observation.environment_state`` (the 39-value
  observation, never given to the policy), the 4-D ``action`` in [-1, 1], ``next.reward``,
  ``next.success`` and ``task_id``;
* an episode ends at its first success or after :data:`STEP_LIMIT` (500) steps, the same for
  collection and evaluation; episode ``i`` of a purpose's seed ``s`` starts from Meta-World's own
  randomisation seeded with :func:`episode_seed` (``s``, task, ``i``): collection, calibration,
  validation (settings chosen) and test (figures reported) use different seeds, so none shares
  an initial state with another and each reproduces from its seed.

Installing: ``metaworld`` 3.1.1 pins ``mujoco==3.3.0``; it is installed without its dependencies
(``pip install --no-deps metaworld==3.1.1``; gymnasium, imageio and scipy come from
requirements-dev.txt). Under mujoco 3.17 each weld constraint holds 12 ``eq_data`` values where
Meta-World's ``reset_mocap_welds`` writes 11: :func:`adapt` patches that method to write the same
11 into the first 11 slots, and refuses (:class:`MetaWorldError`) if the installed Meta-World no
longer matches what it adapts. Rendering is headless OpenGL through MuJoCo (``MUJOCO_GL=egl`` by
default, Debian's ``libegl1``/``libegl-mesa0``; ``osmesa`` with ``libosmesa6``), with shadows,
reflections and skybox off by default (``render_style="fast"``: about 20-25 ms a frame on a 2-core
CPU at any size up to 480 px, against 80-130 ms with Meta-World's own settings, ``"lerobot"``).
"""

from embodied_jax.sim.metaworld.batch import MetaWorldBatch
from embodied_jax.sim.metaworld.closed_loop import BatchPolicy, EvalSettings, evaluate
from embodied_jax.sim.metaworld.collect import (
    CALIBRATION_EPISODES,
    DART_TARGET,
    NOISE_LEVELS,
    ExpertResult,
    calibrate_noise,
    collect,
    expert_episode,
    parse_task_data,
)
from embodied_jax.sim.metaworld.env import (
    GL_PACKAGES,
    RENDER_STYLES,
    MetaWorldEnv,
    View,
    adapt,
    adapted_from,
    check_adaptable,
    check_gl,
    lerobot_task,
)
from embodied_jax.sim.metaworld.suite import (
    ACTION_KEY,
    CALIBRATION_SEED,
    CAMERA,
    CAMERA_POS,
    COLLECTION_SEED,
    DIFFICULTY,
    ENV_STATE_KEY,
    FPS,
    HUB_FEATURES,
    IMAGE_KEY,
    INSTALL,
    INSTRUCTIONS,
    LEROBOT_DESCRIPTIONS,
    LEROBOT_IMAGE_SIZE,
    LEROBOT_TASK_ORDER,
    METAWORLD_CAMERA_POS,
    MT1_SEED,
    MT10,
    MT50,
    PREFIX,
    PROMPTS,
    REWARD_KEY,
    ROBOT_TYPE,
    STATE_KEY,
    STEP_LIMIT,
    SUCCESS_KEY,
    SUITES,
    TASK_ID_KEY,
    TEST_SEED,
    VALIDATION_SEED,
    VERSION,
    MetaWorldError,
    difficulty,
    episode_seed,
    is_metaworld,
    parse_tasks,
    prompt,
    task_id,
)

__all__ = [
    "ACTION_KEY",
    "CALIBRATION_EPISODES",
    "CALIBRATION_SEED",
    "CAMERA",
    "CAMERA_POS",
    "COLLECTION_SEED",
    "DART_TARGET",
    "DIFFICULTY",
    "ENV_STATE_KEY",
    "FPS",
    "HUB_FEATURES",
    "GL_PACKAGES",
    "IMAGE_KEY",
    "INSTALL",
    "INSTRUCTIONS",
    "LEROBOT_DESCRIPTIONS",
    "LEROBOT_IMAGE_SIZE",
    "METAWORLD_CAMERA_POS",
    "LEROBOT_TASK_ORDER",
    "MT10",
    "MetaWorldBatch",
    "MT1_SEED",
    "MT50",
    "NOISE_LEVELS",
    "PREFIX",
    "PROMPTS",
    "RENDER_STYLES",
    "View",
    "REWARD_KEY",
    "ROBOT_TYPE",
    "STATE_KEY",
    "STEP_LIMIT",
    "SUCCESS_KEY",
    "SUITES",
    "TASK_ID_KEY",
    "TEST_SEED",
    "VALIDATION_SEED",
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
    "parse_task_data",
    "difficulty",
    "episode_seed",
    "evaluate",
    "expert_episode",
    "is_metaworld",
    "lerobot_task",
    "parse_tasks",
    "prompt",
    "task_id",
]
