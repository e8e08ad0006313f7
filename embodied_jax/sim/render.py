"""Batch camera rendering: MJX's Warp batch renderer, or the pure-JAX ray-caster.

Both renderers take a *batched* ``mjx.Data`` (leading axis = worlds) whose kinematics
(``geom_xpos``/``geom_xmat``/``cam_xpos``/``cam_xmat``) are current, and return
``{camera: uint8 [B, H, W, 3]}``.

Warp: a render context fixes its number of worlds, so one context is created per
batch size the renderer is called with (at trace time) and reused. Physics may run on
either MJX backend: a JAX-backend ``Data`` is given the Warp-side fields the renderer
needs (execution token, light poses) from a one-world template broadcast to the batch,
so only the kinematic arrays flow from the JAX physics into the Warp kernels.
Warp's buffers are per process and per device ordinal; several virtual CPU devices
share one ordinal, so under a multi-device CPU mesh use the ray-caster.

Ray-caster: see :mod:`embodied_jax.sim.raycast`; vmapped over worlds, shardable.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import mujoco
import numpy as np
from mujoco import mjx

from embodied_jax.sim import raycast

BACKGROUND_RGBA = (*raycast.BACKGROUND, 1.0)


def warp_available() -> bool:
    try:
        import mujoco.mjx.warp as mjxw
    except ImportError:
        return False
    return bool(mjxw.WARP_INSTALLED)


def _to_uint8(rgb: jax.Array) -> jax.Array:
    return jnp.clip(jnp.round(rgb * 255.0), 0, 255).astype(jnp.uint8)


class RaycastRenderer:
    """Pure-JAX renderer of plane/sphere/box scenes; works wherever JAX does."""

    kind = "raycast"

    def __init__(self, model: mujoco.MjModel, cameras: tuple[str, ...], height: int, width: int, *,
                 shadows: bool = True):
        self.cameras, self.height, self.width, self.shadows = tuple(cameras), height, width, shadows
        self._scene = raycast.build_scene(model, self.cameras)
        self._rays = raycast.camera_rays(self._scene, height, width)

    def __call__(self, data: mjx.Data) -> dict[str, jax.Array]:
        def one_world(geom_xpos, geom_xmat, cam_xpos, cam_xmat):
            return raycast.render_cameras(self._scene, self._rays, geom_xpos, geom_xmat, cam_xpos, cam_xmat,
                                          self.height, self.width, shadows=self.shadows)

        images = jax.vmap(one_world)(data.geom_xpos, data.geom_xmat, data.cam_xpos, data.cam_xmat)  # [B, C, H, W, 3]
        return {cam: _to_uint8(images[:, i]) for i, cam in enumerate(self.cameras)}


class WarpRenderer:
    """MJX's Warp batch renderer (CPU or CUDA); physics may be JAX- or Warp-backed."""

    kind = "warp"

    def __init__(self, model: mujoco.MjModel, cameras: tuple[str, ...], height: int, width: int, *,
                 shadows: bool = True):
        if not warp_available():
            raise RuntimeError("the Warp renderer needs mujoco-mjx[warp] (warp-lang); use renderer='raycast'")
        self.cameras, self.height, self.width, self.shadows = tuple(cameras), height, width, shadows
        self._mj_model = model
        self._camera_ids = [int(model.camera(c).id) for c in self.cameras]
        self._contexts: dict[int, object] = {}
        # Constructed possibly while tracing (renderers are created lazily): keep constants concrete.
        with jax.ensure_compile_time_eval():
            self._warp_model = mjx.put_model(model, impl="warp")
            self._template_impl = self._one_world_warp_impl(model)

    @staticmethod
    def _one_world_warp_impl(model: mujoco.MjModel):
        """Warp-side Data fields for one world, with light poses from a CPU forward pass."""
        data = mujoco.MjData(model)
        mujoco.mj_forward(model, data)
        impl = mjx.make_data(model, impl="warp")._impl
        impl = impl.replace(light_xpos=data.light_xpos.astype(np.float32), light_xdir=data.light_xdir.astype(np.float32))
        return jax.tree.map(np.asarray, impl)

    def context(self, num_worlds: int):
        if num_worlds not in self._contexts:
            # On GPUs give every local device its own buffers (shard_map runs one shard per device).
            gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
            self._contexts[num_worlds] = mjx.create_render_context(
                self._mj_model,
                nworld=num_worlds,
                devices=[f"cuda:{d.local_hardware_id}" for d in gpus] or None,
                cam_res=(self.width, self.height),
                render_rgb=True,
                render_depth=False,
                use_textures=False,
                use_shadows=self.shadows,
                cam_active=list(self.cameras),
                background_color=BACKGROUND_RGBA,
            )
        return self._contexts[num_worlds]

    def __call__(self, data: mjx.Data) -> dict[str, jax.Array]:
        num_worlds = data.qpos.shape[0]
        ctx = self.context(num_worlds).pytree()
        if data.impl != mjx.Impl.WARP:
            impl = jax.vmap(lambda _: self._template_impl)(jnp.arange(num_worlds))
            data = data.replace(_impl=impl)
        data = mjx.refit_bvh(self._warp_model, data, ctx)
        rgb, _, _ = mjx.render(self._warp_model, data, ctx)
        return {cam: _to_uint8(mjx.get_rgb(ctx, cid, rgb)) for cam, cid in zip(self.cameras, self._camera_ids)}


def make_renderer(kind: str, model: mujoco.MjModel, cameras: tuple[str, ...], height: int, width: int, *,
                  shadows: bool = True):
    """``kind``: ``"warp"``, ``"raycast"`` or ``"auto"`` (Warp when installed, else the ray-caster).

    ``shadows``: hard shadows from the scene's directional light. They are a depth cue a
    single camera otherwise lacks (where on the table a floating target is above).
    """
    if kind == "auto":
        kind = "warp" if warp_available() else "raycast"
    if kind == "warp":
        return WarpRenderer(model, cameras, height, width, shadows=shadows)
    if kind == "raycast":
        return RaycastRenderer(model, cameras, height, width, shadows=shadows)
    raise ValueError(f"renderer must be 'warp', 'raycast' or 'auto', got {kind!r}")
