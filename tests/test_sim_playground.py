"""The MuJoCo Playground adapter explains how to provide what is missing instead of downloading."""
import importlib.util

import pytest

from embodied_jax.sim import playground


@pytest.mark.skipif(importlib.util.find_spec("mujoco_playground") is not None, reason="Playground is installed")
def test_missing_playground_gives_install_instructions():
    with pytest.raises(playground.PlaygroundUnavailable, match="pip install playground"):
        playground.load_playground_env("PandaPickCube")


@pytest.mark.skipif(importlib.util.find_spec("mujoco_playground") is None, reason="Playground not installed")
def test_missing_menagerie_explains_offline_setup(monkeypatch, tmp_path):
    monkeypatch.setattr(playground, "menagerie_path", lambda: tmp_path / "absent" / "mujoco_menagerie")
    monkeypatch.delenv("MUJOCO_MENAGERIE_DIR", raising=False)
    with pytest.raises(playground.PlaygroundUnavailable, match="menagerie_dir"):
        playground.ensure_assets()
