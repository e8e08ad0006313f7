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

``RendererCache``: an environment's renderers, one per (kind, camera set), bounded.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys

import jax
import jax.numpy as jnp
import mujoco
import numpy as np
from mujoco import mjx

from embodied_jax.sim import raycast

BACKGROUND_RGBA = (*raycast.BACKGROUND, 1.0)


@contextlib.contextmanager
def _native_output_discarded():
    """Discard what C code writes to stdout/stderr (file descriptors 1 and 2) for a moment."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


@functools.cache
def _mjx_warp():
    import warp

    # Warp logs its start-up banner and a "Module ... load" line per kernel at INFO level, and
    # its native library prints a CUDA-driver warning on machines without a GPU while it starts.
    warp.config.log_level = warp.LOG_ERROR
    with _native_output_discarded():
        warp.init()
    import mujoco.mjx.warp as mjxw

    return mjxw


def warp_available() -> bool:
    """Whether MJX's Warp backend is installed (Warp then logs errors only)."""
    try:
        return bool(_mjx_warp().WARP_INSTALLED)
    except ImportError:
        return False


def _to_uint8(rgb: jax.Array) -> jax.Array:
    return jnp.clip(jnp.round(rgb * 255.0), 0, 255).astype(jnp.uint8)


class RaycastRenderer:
    """Pure-JAX renderer of plane/sphere/box scenes; works wherever JAX does."""

    kind = "raycast"

    def __init__(
        self, model: mujoco.MjModel, cameras: tuple[str, ...], height: int, width: int, *, shadows: bool = True
    ):
        self.cameras, self.height, self.width, self.shadows = tuple(cameras), height, width, shadows
        self._scene = raycast.build_scene(model, self.cameras)
        self._rays = raycast.camera_rays(self._scene, height, width)

    def __call__(self, data: mjx.Data) -> dict[str, jax.Array]:
        def one_world(geom_xpos, geom_xmat, cam_xpos, cam_xmat):
            return raycast.render_cameras(
                self._scene,
                self._rays,
                geom_xpos,
                geom_xmat,
                cam_xpos,
                cam_xmat,
                self.height,
                self.width,
                shadows=self.shadows,
            )

        images = jax.vmap(one_world)(data.geom_xpos, data.geom_xmat, data.cam_xpos, data.cam_xmat)  # [B, C, H, W, 3]
        return {cam: _to_uint8(images[:, i]) for i, cam in enumerate(self.cameras)}


class WarpRenderer:
    """MJX's Warp batch renderer (CPU or CUDA); physics may be JAX- or Warp-backed."""

    kind = "warp"

    def __init__(
        self, model: mujoco.MjModel, cameras: tuple[str, ...], height: int, width: int, *, shadows: bool = True
    ):
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
        impl = impl.replace(
            light_xpos=data.light_xpos.astype(np.float32), light_xdir=data.light_xdir.astype(np.float32)
        )
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
        return {
            cam: _to_uint8(mjx.get_rgb(ctx, cid, rgb)) for cam, cid in zip(self.cameras, self._camera_ids, strict=True)
        }


def resolve_kind(kind: str) -> str:
    """``"auto"`` -> ``"warp"`` when Warp is installed, else ``"raycast"``; other kinds unchanged."""
    if kind == "auto":
        return "warp" if warp_available() else "raycast"
    return kind


def make_renderer(
    kind: str, model: mujoco.MjModel, cameras: tuple[str, ...], height: int, width: int, *, shadows: bool = True
):
    """``kind``: ``"warp"``, ``"raycast"`` or ``"auto"`` (Warp when installed, else the ray-caster).

    ``shadows``: hard shadows from the scene's directional light. They are a depth cue a
    single camera otherwise lacks (where on the table a floating target is above).
    """
    kind = resolve_kind(kind)
    if kind == "warp":
        return WarpRenderer(model, cameras, height, width, shadows=shadows)
    if kind == "raycast":
        return RaycastRenderer(model, cameras, height, width, shadows=shadows)
    raise ValueError(f"renderer must be 'warp', 'raycast' or 'auto', got {kind!r}")


class RendererCache:
    """Renderers of one model at one image size, built on first use, one per (kind, cameras).

    Owned by an environment so that every program built on it (rollouts, evaluators) reuses
    them: a renderer is costly to build (Warp contexts) and a new one gives Warp's render
    calls new ids, so the compilation cache could not recognise a rebuilt program. At most
    ``maxsize`` are kept; the least recently used is dropped first (programs already built on
    it keep it alive).
    """

    def __init__(self, model: mujoco.MjModel, height: int, width: int, *, shadows: bool = True, maxsize: int = 8):
        if maxsize < 1:
            raise ValueError(f"RendererCache: maxsize must be >= 1, got {maxsize}")
        self.model, self.height, self.width, self.shadows, self.maxsize = model, height, width, shadows, maxsize
        self._renderers: collections.OrderedDict[tuple[str, tuple[str, ...]], object] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._renderers)

    def get(self, kind: str, cameras: tuple[str, ...]):
        """The ``kind`` (``"auto"`` resolved first) renderer of ``cameras``."""
        key = (resolve_kind(kind), tuple(cameras))
        if key in self._renderers:
            self._renderers.move_to_end(key)
            return self._renderers[key]
        renderer = make_renderer(key[0], self.model, key[1], self.height, self.width, shadows=self.shadows)
        self._renderers[key] = renderer
        if len(self._renderers) > self.maxsize:
            self._renderers.popitem(last=False)
        return renderer
