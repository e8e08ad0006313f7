"""Recommended XLA flags for H100/H200 training, in one place.

``python -m embodied_jax.parallel.xla_flags`` prints them as one ``XLA_FLAGS`` value
(the launch templates export it). Why each one:

- ``xla_gpu_enable_latency_hiding_scheduler``: schedules FSDP all-gathers and
  reduce-scatters early so they overlap with compute instead of stalling it.
- ``xla_gpu_enable_highest_priority_async_stream``: runs collectives on a high-priority
  stream so compute kernels do not starve them.
- ``xla_gpu_all_gather_combine_threshold_bytes`` / ``reduce_scatter`` / ``all_reduce``:
  combine the many per-parameter collectives of a layer into few large ones (NCCL is
  bandwidth-bound only above a few MB per message).
- ``xla_gpu_enable_pipelined_all_gather`` / ``reduce_scatter`` / ``all_reduce``: pipeline the
  collectives of a scanned layer stack with the previous iteration's compute.
- ``xla_gpu_enable_while_loop_double_buffering``: double-buffers the weights of scanned layers.
- ``xla_gpu_enable_command_buffer=`` (empty): CUDA graphs off; they rarely help large
  steps and raise memory use.
"""

from __future__ import annotations

GPU_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_all_gather_combine_threshold_bytes": str(1 << 30),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(1 << 30),
    "xla_gpu_all_reduce_combine_threshold_bytes": str(1 << 30),
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    "xla_gpu_enable_command_buffer": "",
}


def gpu_xla_flags(existing: str = "") -> str:
    """``existing`` XLA_FLAGS plus the recommended GPU flags it does not already set."""
    present = {f.split("=")[0].lstrip("-") for f in existing.split()}
    extra = [f"--{k}={v}" for k, v in GPU_FLAGS.items() if k not in present]
    return " ".join([existing, *extra]).strip()


if __name__ == "__main__":
    import os

    print(gpu_xla_flags(os.environ.get("XLA_FLAGS", "")))
