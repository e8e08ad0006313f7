"""``--virtual-devices N``: make this process a CPU host with N simulated devices.

Compiling for a cluster one does not have (MaxText's ahead-of-time practice): with N
virtual CPU devices, ``--dry-run --compile`` partitions the train step exactly as it would
for N accelerators and reports per-device memory and collectives. The device count is fixed
when JAX starts its backends, so this must run before any JAX computation.
"""

from __future__ import annotations

import jax

from embodied_jax.errors import InputError


class VirtualDevicesError(InputError, RuntimeError):
    """JAX already runs with another device set."""


def backends_started() -> bool:
    from jax._src import xla_bridge  # no public query for this

    return xla_bridge.backends_are_initialized()


def use_virtual_devices(count: int) -> None:
    """Run JAX on ``count`` CPU devices; raises if JAX has already started otherwise."""
    if count < 1:
        raise VirtualDevicesError(f"--virtual-devices {count}: need at least 1 device")
    if backends_started():
        devices = jax.devices()
        if len(devices) == count and {d.platform for d in devices} == {"cpu"}:
            return
        raise VirtualDevicesError(
            f"--virtual-devices {count}: JAX is already initialised with {len(devices)} "
            f"{'/'.join(sorted({d.platform for d in devices}))} device(s); the device count is fixed when JAX "
            f"starts, so pass it before anything runs JAX (or start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} JAX_PLATFORMS=cpu)"
        )
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)
