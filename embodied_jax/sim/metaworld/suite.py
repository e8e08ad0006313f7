"""Meta-World's task suite as the project names it: task names, the instruction written per task,
MT10 / MT50 and the difficulty groups, the episode limit and the per-episode reset seeds."""

from __future__ import annotations

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


def episode_seed(seed: int, task: str, episode: int) -> int:
    """The reset seed of ``episode`` of ``task`` in a run seeded ``seed``."""
    index = MT50.index(task)
    return int(np.random.SeedSequence([seed, index, episode]).generate_state(1)[0])
