"""Batch rendering (Warp batch renderer and the pure-JAX ray-caster fallback).

Scenes are set up on the CPU (``mujoco.MjData``) and moved onto MJX with ``put_data``,
so no physics is compiled here: only the renderers.
"""

import jax
import jax.numpy as jnp
import mujoco
import numpy as np
import pytest
from mujoco import mjx

from embodied_jax.sim import env as env_lib
from embodied_jax.sim import render as render_lib

HEIGHT, WIDTH = 48, 64
KINDS = ["raycast"] + (["warp"] if render_lib.warp_available() else [])
CUBE_START = np.array([0.08, 0.05, 0.02])


def _scene_states(env):
    """Worlds: [base, cube moved, arm moved]; returns (batched EnvState, list of MjData)."""
    m = env.mj_model
    cube = m.joint("cube").qposadr[0]
    datas = []
    for cube_shift, arm_shift in ((0.0, 0.0), (-0.16, 0.0), (0.0, 0.12)):
        d = mujoco.MjData(m)
        d.qpos[cube : cube + 3] = CUBE_START + np.array([cube_shift, 0, 0])
        d.qpos[cube + 3 : cube + 7] = [1, 0, 0, 0]
        d.qpos[0:5] = [-0.05 + arm_shift, -0.05, 0.15, 0.045, 0.045]
        d.mocap_pos[m.body_mocapid[m.body("goal").id]] = [-0.1, -0.1, 0.001]
        mujoco.mj_forward(m, d)
        datas.append(d)
    data = jax.tree.map(lambda *xs: jnp.stack(xs), *[mjx.put_data(m, d) for d in datas])
    n = len(datas)
    states = env_lib.EnvState(
        data=data,
        info={},
        step=jnp.zeros(n, jnp.int32),
        reward=jnp.zeros(n),
        success=jnp.zeros(n, bool),
        done=jnp.zeros(n, bool),
    )
    return states, datas


@pytest.fixture(scope="module")
def renders():
    """kind -> (env, images, MjData list): each renderer draws the same three worlds once."""
    out = {}
    for kind in KINDS:
        env = env_lib.Env("pick_place", env_lib.EnvConfig(image_size=(HEIGHT, WIDTH), renderer=kind))
        states, datas = _scene_states(env)
        out[kind] = env, jax.tree.map(np.asarray, jax.jit(env.render)(states)), datas
    return out


@pytest.fixture(params=KINDS)
def rendered(request, renders):
    return (request.param, *renders[request.param])


def _blue_mask(img):
    img = img.astype(np.int32)
    return (img[..., 2] > 120) & (img[..., 2] > img[..., 0] + 60) & (img[..., 2] > img[..., 1] + 30)


def _project(model, data, camera, point):
    """Pinhole projection (row, col) of a world point into a MuJoCo camera, in NumPy."""
    cid = model.camera(camera).id
    rel = data.cam_xmat[cid].reshape(3, 3).T @ (point - data.cam_xpos[cid])
    focal = 0.5 * HEIGHT / np.tan(np.deg2rad(model.cam_fovy[cid]) / 2)
    return HEIGHT / 2 - focal * rel[1] / -rel[2], WIDTH / 2 + focal * rel[0] / -rel[2]


def test_images_have_configured_shape_and_content(rendered):
    kind, env, images, _ = rendered
    assert set(images) == {"scene", "wrist"}
    for cam, img in images.items():
        assert img.shape == (3, HEIGHT, WIDTH, 3) and img.dtype == np.uint8, (kind, cam, img.shape)
        for frame in img:  # never blank
            assert frame.std() > 10 and len(np.unique(frame.reshape(-1, 3), axis=0)) >= 5, (kind, cam)


def test_images_change_when_object_or_robot_moves(rendered):
    kind, _, images, _ = rendered
    scene, wrist = images["scene"].astype(int), images["wrist"].astype(int)
    assert np.abs(scene[1] - scene[0]).sum() > 0, f"{kind}: scene camera ignores the cube moving"
    assert np.abs(scene[2] - scene[0]).sum() > 0, f"{kind}: scene camera ignores the arm moving"
    assert np.abs(wrist[2] - wrist[0]).sum() > 0, f"{kind}: wrist camera ignores the arm moving"


def test_cube_appears_where_the_camera_model_projects_it(rendered):
    kind, env, images, datas = rendered
    for world, d in enumerate(datas[:2]):
        cube = d.qpos[env.mj_model.joint("cube").qposadr[0] :][:3]
        rows, cols = np.nonzero(_blue_mask(images["scene"][world]))
        assert rows.size > 0, f"{kind}: no cube pixels in world {world}"
        row, col = _project(env.mj_model, d, "scene", cube)
        assert abs(rows.mean() - row) < 2.5 and abs(cols.mean() - col) < 2.5, (
            kind,
            world,
            rows.mean(),
            row,
            cols.mean(),
            col,
        )


@pytest.mark.skipif(len(KINDS) < 2, reason="Warp not installed")
def test_raycaster_agrees_with_warp_renderer(renders):
    a, b = renders["warp"][1]["scene"], renders["raycast"][1]["scene"]
    for world in range(a.shape[0]):
        ma, mb = _blue_mask(a[world]), _blue_mask(b[world])
        iou = (ma & mb).sum() / max(1, (ma | mb).sum())
        assert iou > 0.4, (world, iou)
    assert np.abs(a.astype(int) - b.astype(int)).mean() < 40


def test_bad_renderer_name_is_rejected():
    env = env_lib.Env("reach", env_lib.EnvConfig(renderer="opengl"))
    with pytest.raises(ValueError, match="renderer must be"):
        env.renderer()


def test_renderers_are_owned_by_the_env_and_bounded():
    env = env_lib.Env("reach", env_lib.EnvConfig(image_size=(8, 8), renderer="raycast", shadows=False))
    assert isinstance(env.renderers, render_lib.RendererCache)
    every = env.renderer()
    assert every.cameras == env.cameras and env.renderer(env.cameras, kind="raycast") is every
    scene = env.renderer(("scene",))
    assert scene is not every and len(env.renderers) == 2
    cache = render_lib.RendererCache(env.mj_model, 8, 8, shadows=False, maxsize=2)
    a, b = cache.get("raycast", ("scene",)), cache.get("raycast", env.cameras)
    assert cache.get("raycast", ("scene",)) is a  # a is now the most recently used
    cache.get("raycast", ("wrist",))  # evicts b
    assert len(cache) == 2 and cache.get("raycast", ("scene",)) is a
    assert cache.get("raycast", env.cameras) is not b
    with pytest.raises(ValueError, match="renderer must be"):
        cache.get("opengl", ("scene",))
