"""``jax.distributed`` initialisation: explicit flags or auto-detection of the cluster.

Resolution order: explicit ``coordinator/num_processes/process_id`` (the launcher's
``--coordinator/--num-processes/--process-id``), then SLURM, Kubernetes (JobSet or an
Indexed Job), Open MPI. A single process needs no initialisation at all.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from typing import Annotated

import jax
import tyro

from embodied_jax.config_registry import register

log = logging.getLogger(__name__)

DEFAULT_PORT = 6789


@register
@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    # The launcher also accepts these three as --coordinator, --num-processes and --process-id.
    coordinator: Annotated[str | None, tyro.conf.arg(aliases=("--coordinator",))] = None  # "host:port"
    num_processes: Annotated[int | None, tyro.conf.arg(aliases=("--num-processes",))] = None
    process_id: Annotated[int | None, tyro.conf.arg(aliases=("--process-id",))] = None
    local_device_ids: tuple[int, ...] | None = None
    port: int = DEFAULT_PORT  # used when the coordinator is detected without a port


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    coordinator: str
    num_processes: int
    process_id: int
    source: str


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``gpu[003-005,009],cpu1``."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if head is None:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = head.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_cluster(env: Mapping[str, str] | None = None, port: int = DEFAULT_PORT) -> ClusterSpec | None:
    """The cluster this process belongs to, from the environment, or None for a single process."""
    env = os.environ if env is None else env

    def addr(host: str) -> str:
        return host if ":" in host else f"{host}:{port}"

    if "EMBODIED_JAX_COORDINATOR" in env:
        return ClusterSpec(
            addr(env["EMBODIED_JAX_COORDINATOR"]),
            int(env["EMBODIED_JAX_NUM_PROCESSES"]),
            int(env["EMBODIED_JAX_PROCESS_ID"]),
            "EMBODIED_JAX_* variables",
        )
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("SLURM job without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: cannot find the coordinator")
        return ClusterSpec(
            addr(_first_slurm_host(nodelist)), int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]), "SLURM"
        )
    if "JOB_COMPLETION_INDEX" in env and (
        "JOBSET_NAME" in env or "EMBODIED_JAX_NUM_PROCESSES" in env or "NUM_PROCESSES" in env
    ):
        # JobSet: pods are named <jobset>-<replicatedjob>-<jobindex>-<podindex>.<subdomain>.
        num = int(env.get("NUM_PROCESSES") or env["EMBODIED_JAX_NUM_PROCESSES"])
        if "COORDINATOR_ADDRESS" in env:
            host = env["COORDINATOR_ADDRESS"]
        elif "JOBSET_NAME" in env:
            job = env.get("REPLICATED_JOB_NAME", "workers")
            subdomain = env.get("JOBSET_SUBDOMAIN", env["JOBSET_NAME"])
            host = f"{env['JOBSET_NAME']}-{job}-0-0.{subdomain}"
        else:
            raise ValueError("Kubernetes Indexed Job needs COORDINATOR_ADDRESS (the pod with index 0)")
        return ClusterSpec(addr(host), num, int(env["JOB_COMPLETION_INDEX"]), "Kubernetes")
    if "OMPI_COMM_WORLD_SIZE" in env and int(env["OMPI_COMM_WORLD_SIZE"]) > 1:
        host = env.get("COORDINATOR_ADDRESS") or env.get("MASTER_ADDR")
        if not host:
            raise ValueError("Open MPI job: set COORDINATOR_ADDRESS (or MASTER_ADDR) to rank 0's host")
        return ClusterSpec(addr(host), int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_RANK"]), "Open MPI")
    return None


def initialize(
    config: DistributedConfig = DistributedConfig(), env: Mapping[str, str] | None = None
) -> ClusterSpec | None:
    """Call ``jax.distributed.initialize`` when this is a multi-process job; return what was used."""
    if config.coordinator is not None or config.num_processes is not None or config.process_id is not None:
        missing = [n for n in ("coordinator", "num_processes", "process_id") if getattr(config, n) is None]
        if missing:
            flags = ", ".join("--" + m.replace("_", "-") for m in missing)
            raise ValueError(f"distributed: explicit initialisation needs {flags} too")
        spec = ClusterSpec(config.coordinator, config.num_processes, config.process_id, "command line")
    else:
        spec = detect_cluster(env, config.port)
    if spec is None or spec.num_processes == 1:
        return spec
    if not 0 <= spec.process_id < spec.num_processes:
        raise ValueError(f"distributed: process_id={spec.process_id} outside [0, {spec.num_processes})")
    log.info(
        "jax.distributed: process %d/%d, coordinator %s (%s)",
        spec.process_id,
        spec.num_processes,
        spec.coordinator,
        spec.source,
    )
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        local_device_ids=list(config.local_device_ids) if config.local_device_ids else None,
    )
    return spec
