"""Meta-World's task suite as LeRobot runs it: task names, the prompts (LeRobot's task descriptions,
or the project's own sentences), MT10 / MT50 and the difficulty groups, the environment's settings
(MT1 seed, camera pose, episode limit) and the per-episode reset seeds of each purpose."""

from __future__ import annotations

import numpy as np

from embodied_jax.errors import InputError
from embodied_jax.sim.seeds import CALIBRATION_SEED, COLLECTION_SEED, TEST_SEED, VALIDATION_SEED  # noqa: F401

PREFIX = "metaworld:"
VERSION = "3.1.1"
CAMERA = "corner2"
# LeRobot's environment (``lerobot/envs/metaworld.py``): each task is ``MT1(task, seed=42)``'s train
# class with ``set_task(train_tasks[0])``, ``corner2`` moved to this position before the first reset,
# its frames flipped on both axes, 480x480 renders, at most ``max_path_length`` = 500 steps, and the
# episode ended by the first success.
MT1_SEED = 42
CAMERA_POS = (0.75, 0.075, 0.7)
METAWORLD_CAMERA_POS = (1.3, -0.2, 1.1)  # corner2 as Meta-World compiles it (the project's camera before)
LEROBOT_IMAGE_SIZE = (480, 480)
IMAGE_KEY = "observation.image"
STATE_KEY = "observation.state"
ENV_STATE_KEY = "observation.environment_state"  # Meta-World's 39-value observation; never the policy's
REWARD_KEY = "next.reward"
SUCCESS_KEY = "next.success"
TASK_ID_KEY = "task_id"
ACTION_KEY = "action"
STEP_LIMIT = 500  # steps per episode: Meta-World's max_path_length, as LeRobot evaluates
FPS = 80  # Meta-World's control rate: 5 physics substeps of 2.5 ms

# Reset seeds by purpose (``episode_seed(purpose, task, i)``, ``sim/seeds.py``): no two purposes share
# a start state. Settings are chosen on the validation seed (in-training evaluation, levers);
# reported figures are measured on the test seed only.
ROBOT_TYPE = "metaworld"  # as the hub dataset names it
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

# LeRobot's task descriptions (``metaworld_config.json``: ``TASK_DESCRIPTIONS``), the prompts its
# environments give a policy and its hub dataset ``lerobot/metaworld_mt50`` stores. push and push-back
# share one description, as there.
LEROBOT_DESCRIPTIONS = {
    "assembly": "Pick up a nut and place it onto a peg",
    "basketball": "Dunk the basketball into the basket",
    "bin-picking": "Grasp the puck from one bin and place it into another bin",
    "box-close": "Grasp the cover and close the box with it",
    "button-press-topdown": "Press a button from the top",
    "button-press-topdown-wall": "Bypass a wall and press a button from the top",
    "button-press": "Press a button",
    "button-press-wall": "Bypass a wall and press a button",
    "coffee-button": "Push a button on the coffee machine",
    "coffee-pull": "Pull a mug from a coffee machine",
    "coffee-push": "Push a mug under a coffee machine",
    "dial-turn": "Rotate a dial 180 degrees",
    "disassemble": "Pick a nut out of a peg",
    "door-close": "Close a door with a revolving joint",
    "door-lock": "Lock the door by rotating the lock clockwise",
    "door-open": "Open a door with a revolving joint",
    "door-unlock": "Unlock the door by rotating the lock counter-clockwise",
    "hand-insert": "Insert the gripper into a hole",
    "drawer-close": "Push and close a drawer",
    "drawer-open": "Open a drawer",
    "faucet-open": "Rotate the faucet counter-clockwise",
    "faucet-close": "Rotate the faucet clockwise",
    "hammer": "Hammer a screw on the wall",
    "handle-press-side": "Press a handle down sideways",
    "handle-press": "Press a handle down",
    "handle-pull-side": "Pull a handle up sideways",
    "handle-pull": "Pull a handle up",
    "lever-pull": "Pull a lever down 90 degrees",
    "peg-insert-side": "Insert a peg sideways",
    "pick-place-wall": "Pick a puck, bypass a wall and place the puck",
    "pick-out-of-hole": "Pick up a puck from a hole",
    "reach": "Reach a goal position",
    "push-back": "Push the puck to a goal",
    "push": "Push the puck to a goal",
    "pick-place": "Pick and place a puck to a goal",
    "plate-slide": "Slide a plate into a cabinet",
    "plate-slide-side": "Slide a plate into a cabinet sideways",
    "plate-slide-back": "Get a plate from the cabinet",
    "plate-slide-back-side": "Get a plate from the cabinet sideways",
    "peg-unplug-side": "Unplug a peg sideways",
    "soccer": "Kick a soccer into the goal",
    "stick-push": "Grasp a stick and push a box using the stick",
    "stick-pull": "Grasp a stick and pull a box with the stick",
    "push-wall": "Bypass a wall and push a puck to a goal",
    "reach-wall": "Bypass a wall and reach a goal",
    "shelf-place": "Pick and place a puck onto a shelf",
    "sweep-into": "Sweep a puck into a hole",
    "sweep": "Sweep a puck off the table",
    "window-open": "Push and open a window",
    "window-close": "Push and close a window",
}

# One English sentence per task naming its goal, written for this project: the ``project`` prompts
# (for instance, prompts a policy trained on LeRobot's descriptions never saw).
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
PROMPTS = {"lerobot": LEROBOT_DESCRIPTIONS, "project": INSTRUCTIONS}

# The features of the hub's ``lerobot/metaworld_mt50`` (LeRobot v3.0, 80 fps): dtype and shape of each,
# images stated channels-first as there (480x480 in the hub's; collected here at the size asked for).
HUB_FEATURES = {
    IMAGE_KEY: ("image", [3, *LEROBOT_IMAGE_SIZE]),
    STATE_KEY: ("float32", [4]),
    ENV_STATE_KEY: ("float32", [39]),
    ACTION_KEY: ("float32", [4]),
    REWARD_KEY: ("float32", [1]),
    SUCCESS_KEY: ("bool", [1]),
    TASK_ID_KEY: ("int16", [1]),
    "timestamp": ("float32", [1]),
    "frame_index": ("int64", [1]),
    "episode_index": ("int64", [1]),
    "index": ("int64", [1]),
    "task_index": ("int64", [1]),
}

# LeRobot's task ids (``TASK_NAME_TO_ID``, the hub dataset's ``task_id``): position in this tuple.
LEROBOT_TASK_ORDER = (
    "assembly",
    "basketball",
    "bin-picking",
    "box-close",
    "button-press-topdown",
    "button-press-topdown-wall",
    "button-press",
    "button-press-wall",
    "coffee-button",
    "coffee-pull",
    "coffee-push",
    "dial-turn",
    "disassemble",
    "door-close",
    "door-lock",
    "door-open",
    "door-unlock",
    "drawer-close",
    "drawer-open",
    "faucet-close",
    "faucet-open",
    "hammer",
    "hand-insert",
    "handle-press-side",
    "handle-press",
    "handle-pull-side",
    "handle-pull",
    "lever-pull",
    "peg-insert-side",
    "peg-unplug-side",
    "pick-out-of-hole",
    "pick-place",
    "pick-place-wall",
    "plate-slide-back-side",
    "plate-slide-back",
    "plate-slide-side",
    "plate-slide",
    "push-back",
    "push",
    "push-wall",
    "reach",
    "reach-wall",
    "shelf-place",
    "soccer",
    "stick-pull",
    "stick-push",
    "sweep-into",
    "sweep",
    "window-open",
    "window-close",
)


class MetaWorldError(InputError, ValueError):
    """Meta-World missing, a task it does not have, or an installed version this adapter does not fit."""


def prompt(task: str, prompts: str = "lerobot") -> str:
    """The sentence a policy is given for ``task``: LeRobot's description or the project's own."""
    if prompts not in PROMPTS:
        raise MetaWorldError(f"prompts={prompts!r}: one of {', '.join(PROMPTS)}")
    return PROMPTS[prompts][task]


def task_id(task: str) -> int:
    """LeRobot's ``TASK_NAME_TO_ID``: the hub dataset's ``task_id`` of ``task``."""
    return LEROBOT_TASK_ORDER.index(task)


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


def episode_seed(seed: int, task: str, episode: int) -> int:
    """The reset seed of ``episode`` of ``task`` in a run seeded ``seed``."""
    index = MT50.index(task)
    return int(np.random.SeedSequence([seed, index, episode]).generate_state(1)[0])
