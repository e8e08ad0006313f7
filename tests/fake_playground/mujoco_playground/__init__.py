"""A stand-in for MuJoCo Playground in tests: the slice of its API that the adapter uses.

Layout and names follow the real package (``registry.manipulation.ALL_ENVS``,
``registry.load(name, config_overrides=...)``, ``State``, robot assets read from
``external_deps/mujoco_menagerie`` inside the package). Its one env slides a box on a
rail in a model that the test writes into that menagerie directory. Tests copy this
package into a temporary directory, so linking assets into it never touches the repo.
"""

from mujoco_playground import manipulation, registry
from mujoco_playground.mjx_env import State

__all__ = ["manipulation", "registry", "State"]
