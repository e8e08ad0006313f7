"""Pure-JAX ray-casting renderer: the fallback when MuJoCo Warp is not installed.

It draws the real scene content, never a blank frame: one primary ray per pixel is
intersected analytically with every visible primitive geom (plane, sphere, box) at
its current world pose (``geom_xpos``/``geom_xmat``), and the nearest hit is shaded
with the geom's colour under the model's headlight and first directional light
(Lambert), with hard shadows from that directional light: a second ray from each hit point
towards the light tests every non-plane geom. Cameras use the model's ``cam_fovy`` and the current
``cam_xpos``/``cam_xmat``, so the images match MuJoCo's viewpoint.

Everything is ``jit``/``vmap``-able and runs one world at a time; the caller vmaps it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import mujoco
import numpy as np

BACKGROUND = (0.35, 0.4, 0.5)
_SUPPORTED = {
    int(mujoco.mjtGeom.mjGEOM_PLANE): "plane",
    int(mujoco.mjtGeom.mjGEOM_SPHERE): "sphere",
    int(mujoco.mjtGeom.mjGEOM_BOX): "box",
}
_FAR = 1e6


@dataclasses.dataclass(frozen=True)
class RaycastScene:
    """Static, host-side description of what to draw (built once per model)."""

    geom_ids: tuple[int, ...]
    geom_types: tuple[str, ...]
    sizes: np.ndarray  # [G, 3]
    colors: np.ndarray  # [G, 3]
    camera_ids: tuple[int, ...]
    fovy: np.ndarray  # [C] degrees
    headlight: tuple[np.ndarray, np.ndarray]  # ambient, diffuse
    light_dir: np.ndarray  # [3] direction the light travels (world)
    light_diffuse: np.ndarray  # [3]


def build_scene(model: mujoco.MjModel, cameras: tuple[str, ...]) -> RaycastScene:
    """Collect visible geoms (groups 0-2, alpha > 0) and the named cameras."""
    ids, types, unsupported = [], [], []
    for g in range(model.ngeom):
        rgba = model.mat_rgba[model.geom_matid[g]] if model.geom_matid[g] >= 0 else model.geom_rgba[g]
        if model.geom_group[g] > 2 or rgba[3] <= 0:
            continue
        kind = _SUPPORTED.get(int(model.geom_type[g]))
        if kind is None:
            unsupported.append(mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_GEOM, g) or f"geom {g}")
            continue
        ids.append(g)
        types.append(kind)
    if unsupported:
        raise ValueError(
            f"the JAX ray-caster draws only plane/sphere/box geoms; unsupported visible geoms: {unsupported}. "
            "Install mujoco-mjx[warp] to render this model with the Warp batch renderer."
        )
    colors = np.stack(
        [(model.mat_rgba[model.geom_matid[g]] if model.geom_matid[g] >= 0 else model.geom_rgba[g])[:3] for g in ids]
    ).astype(np.float32)
    cam_ids = tuple(int(model.camera(c).id) for c in cameras)
    dir_lights = [i for i in range(model.nlight) if model.light_type[i] == mujoco.mjtLightType.mjLIGHT_DIRECTIONAL]
    if dir_lights:
        li = dir_lights[0]
        light_dir = model.light_dir[li] / np.linalg.norm(model.light_dir[li])
        light_diffuse = model.light_diffuse[li]
    else:
        light_dir, light_diffuse = np.array([0.0, 0.0, -1.0]), np.zeros(3)
    return RaycastScene(
        geom_ids=tuple(ids),
        geom_types=tuple(types),
        sizes=model.geom_size[ids].astype(np.float32),
        colors=colors,
        camera_ids=cam_ids,
        fovy=model.cam_fovy[list(cam_ids)].astype(np.float32),
        headlight=(model.vis.headlight.ambient.copy(), model.vis.headlight.diffuse.copy()),
        light_dir=light_dir.astype(np.float32),
        light_diffuse=np.asarray(light_diffuse, np.float32),
    )


def _camera_rays(fovy_deg: float, height: int, width: int) -> np.ndarray:
    """Unit ray directions in the camera frame (x right, y up, looking along -z), [H*W, 3]."""
    focal = 0.5 * height / np.tan(np.deg2rad(fovy_deg) / 2)
    rows, cols = np.meshgrid(np.arange(height) + 0.5, np.arange(width) + 0.5, indexing="ij")
    d = np.stack([(cols - width / 2) / focal, -(rows - height / 2) / focal, -np.ones_like(rows)], -1)
    return (d / np.linalg.norm(d, axis=-1, keepdims=True)).reshape(-1, 3).astype(np.float32)


def _hit_sphere(o, d, size):
    b = jnp.sum(o * d, -1)
    c = jnp.sum(o * o, -1) - size[0] ** 2
    disc = b * b - c
    t = -b - jnp.sqrt(jnp.maximum(disc, 0.0))
    ok = (disc > 0) & (t > 0)
    normal = (o + t[:, None] * d) / size[0]
    return jnp.where(ok, t, _FAR), normal


def _hit_box(o, d, size):
    safe = jnp.where(jnp.abs(d) < 1e-9, 1e-9, d)
    t1 = (-size - o) / safe
    t2 = (size - o) / safe
    near = jnp.minimum(t1, t2)
    t_near = near.max(-1)
    t_far = jnp.maximum(t1, t2).min(-1)
    ok = (t_far >= t_near) & (t_near > 0)
    axis = jax.nn.one_hot(near.argmax(-1), 3)
    normal = -axis * jnp.sign(d)
    return jnp.where(ok, t_near, _FAR), normal


def _hit_plane(o, d, size):
    t = -o[:, 2] / jnp.where(jnp.abs(d[:, 2]) < 1e-9, -1e-9, d[:, 2])
    p = o + t[:, None] * d
    inside = jnp.where(size[0] > 0, jnp.abs(p[:, 0]) <= size[0], True) & jnp.where(
        size[1] > 0, jnp.abs(p[:, 1]) <= size[1], True
    )
    ok = (d[:, 2] < 0) & (t > 0) & inside
    normal = jnp.broadcast_to(jnp.array([0.0, 0.0, 1.0]), o.shape)
    return jnp.where(ok, t, _FAR), normal


_HIT = {"sphere": _hit_sphere, "box": _hit_box, "plane": _hit_plane}


def _nearest_hit(scene: RaycastScene, origin, rays, geom_xpos, geom_xmat, *, include_planes: bool = True):
    """Distance, world normal and colour of the nearest geom along each ray (``_FAR`` if none).

    One ``lax.scan`` per primitive type over that type's geoms: the compiled program stays
    the same size however many geoms a scene has.
    """
    origin = jnp.broadcast_to(origin, rays.shape)
    best = (
        jnp.full(rays.shape[:1], _FAR),
        jnp.zeros_like(rays),
        jnp.broadcast_to(jnp.asarray(BACKGROUND, jnp.float32), rays.shape),
    )
    for kind, hit in _HIT.items():
        members = [i for i, k in enumerate(scene.geom_types) if k == kind]
        if not members or (kind == "plane" and not include_planes):
            continue
        ids = np.asarray([scene.geom_ids[i] for i in members])
        geoms = (geom_xpos[ids], geom_xmat[ids], jnp.asarray(scene.sizes[members]), jnp.asarray(scene.colors[members]))

        def nearer(best, geom, hit=hit):
            pos, rot, size, color = geom
            t, n_local = hit((origin - pos) @ rot, rays @ rot, size)
            best_t, best_n, best_c = best
            closer = t < best_t
            return (
                jnp.where(closer, t, best_t),
                jnp.where(closer[:, None], n_local @ rot.T, best_n),
                jnp.where(closer[:, None], color, best_c),
            ), None

        best, _ = jax.lax.scan(nearer, best, geoms)
    return best


def camera_rays(scene: RaycastScene, height: int, width: int) -> np.ndarray:
    """Unit ray directions of every camera in its own frame, [C, H*W, 3]."""
    return np.stack([_camera_rays(float(f), height, width) for f in scene.fovy])


def render_cameras(
    scene: RaycastScene,
    rays,
    geom_xpos,
    geom_xmat,
    cam_xpos,
    cam_xmat,
    height: int,
    width: int,
    *,
    shadows: bool = True,
) -> jax.Array:
    """RGB float32 [C, H, W, 3] in [0, 1] of every camera of ``scene`` in one world.

    ``rays``: :func:`camera_rays` of the scene. The cameras are vmapped: one compiled
    camera whatever their number.
    """
    cams = np.asarray(scene.camera_ids)
    return jax.vmap(
        lambda r, pos, mat: _shade(scene, r @ mat.T, pos, geom_xpos, geom_xmat, height, width, shadows=shadows)
    )(jnp.asarray(rays), cam_xpos[cams], cam_xmat[cams])


def _shade(scene: RaycastScene, rays, origin, geom_xpos, geom_xmat, height: int, width: int, *, shadows: bool):
    best_t, best_n, best_c = _nearest_hit(scene, origin, rays, geom_xpos, geom_xmat)
    ambient, head_diffuse = (jnp.asarray(v, jnp.float32) for v in scene.headlight)
    facing_camera = jnp.abs(jnp.sum(best_n * rays, -1, keepdims=True))
    light_dir = jnp.asarray(scene.light_dir)
    sun = jnp.maximum(0.0, -jnp.sum(best_n * light_dir, -1, keepdims=True))
    if shadows:
        # Planes only receive shadows (a ground plane cannot occlude anything above it).
        points = origin + jnp.minimum(best_t, 1e3)[:, None] * rays + 1e-4 * best_n
        blocker_t, _, _ = _nearest_hit(
            scene, points, jnp.broadcast_to(-light_dir, rays.shape), geom_xpos, geom_xmat, include_planes=False
        )
        sun = jnp.where((blocker_t < _FAR)[:, None], 0.0, sun)
    shade = ambient + head_diffuse * facing_camera + jnp.asarray(scene.light_diffuse) * sun
    lit = jnp.clip(best_c * shade, 0.0, 1.0)
    hit = (best_t < _FAR)[:, None]
    return jnp.where(hit, lit, best_c).reshape(height, width, 3)
