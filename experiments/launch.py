"""``python -m experiments.launch [NAME] [--overrides]``: run a named experiment.

``--help`` lists the experiments; ``NAME --help`` lists every field that can be
overridden. With no NAME it runs the default demo. ``--dry-run`` (with ``--compile``)
only reports shapes, parameter counts, memory and collectives; ``--virtual-devices N``
simulates N CPU devices, so ``NAME --dry-run --compile --virtual-devices 256 --mesh.data 1
--mesh.fsdp 256`` compiles the step for a 256-device cluster. Multi-process jobs take
``--coordinator HOST:PORT --num-processes N --process-id I`` or find their peers
from SLURM, Kubernetes or Open MPI variables.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import tyro


def _split_distributed_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    return parser.parse_known_args(argv)


def parse(argv: list[str]):
    from experiments.registry import DEFAULT, experiments

    dist, rest = _split_distributed_args(argv)
    known = experiments()
    defaults = {name: factory() for name, (_, factory) in known.items()}
    descriptions = {name: desc for name, (desc, _) in known.items()}
    config_type = tyro.extras.subcommand_type_from_defaults(defaults, descriptions)
    config = tyro.cli(config_type, default=defaults[DEFAULT], args=rest, prog="python -m experiments.launch",
                      description=__doc__.split("\n\n")[0])
    if dist.coordinator or dist.num_processes or dist.process_id is not None:
        config = dataclasses.replace(config, distributed=dataclasses.replace(
            config.distributed, coordinator=dist.coordinator, num_processes=dist.num_processes,
            process_id=dist.process_id))
    return config


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = parse(sys.argv[1:] if argv is None else argv)

    from embodied_jax.parallel.virtual_devices import VirtualDevicesError, use_virtual_devices
    from embodied_jax.train.loop import ConfigError, NonFiniteLossError, Preempted, build, train

    try:
        if config.virtual_devices is not None:
            use_virtual_devices(config.virtual_devices)
        if config.dry_run:
            from embodied_jax.parallel import distributed
            from embodied_jax.train.dry_run import report

            distributed.initialize(config.distributed)
            report(build(config), compile=config.compile, gpu_memory_gb=config.gpu_memory_gb)
            return 0
        if config.compile or config.gpu_memory_gb:
            raise ConfigError("compile: --compile and --gpu-memory-gb only apply together with --dry-run")
        if hasattr(config, "run"):  # experiments with steps around training (the demo)
            return config.run()
        result = train(config)
    except (ConfigError, VirtualDevicesError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except Preempted as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum
    curve = [(h["step"], h["loss"]) for h in result.history if "loss" in h]
    if curve:
        print("loss curve: " + ", ".join(f"{s}:{loss:.4f}" for s, loss in curve))
    print(f"finished at step {result.final_step}; outputs in {result.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
