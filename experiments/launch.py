"""``python -m experiments.launch [NAME] [--overrides]``: run a named experiment.

``--help`` lists the experiments; ``NAME --help`` lists every field that can be
overridden. With no NAME it runs the default demo. ``--dry-run`` (with ``--compile``)
checks the dataset against the model, as a run does first, then only reports shapes,
parameter counts, memory and collectives; ``--virtual-devices N``
simulates N CPU devices, so ``NAME --dry-run --compile --virtual-devices 256 --mesh.data 1
--mesh.fsdp 256`` compiles the step for a 256-device cluster. Multi-process jobs take
``--coordinator HOST:PORT --num-processes N --process-id I`` or find their peers
from SLURM, Kubernetes or Open MPI variables.
"""

from __future__ import annotations

import logging
import sys

import tyro

from embodied_jax.cli import INPUT_ERRORS, fail, parse_flags, renamed_flags
from embodied_jax.data.sources import FLAG_RENAMES


def parse(argv: list[str]):
    from experiments.registry import DEFAULT, experiments

    known = experiments()
    defaults = {name: factory() for name, (_, factory) in known.items()}
    descriptions = {name: desc for name, (desc, _) in known.items()}
    config_type = tyro.extras.subcommand_type_from_defaults(defaults, descriptions)
    return parse_flags(
        config_type,
        default=defaults[DEFAULT],
        args=renamed_flags(argv, FLAG_RENAMES),
        prog="python -m experiments.launch",
        description=__doc__.split("\n\n")[0],
    )


def main(argv: list[str] | None = None) -> int:
    # The project's own INFO lines; other libraries' warnings and errors. absl (Orbax's logger)
    # warns about its own type-handler registry on every start: errors only.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("embodied_jax").setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.ERROR)
    config = parse(sys.argv[1:] if argv is None else argv)

    from embodied_jax.parallel.virtual_devices import use_virtual_devices
    from embodied_jax.train.loop import NonFiniteLossError, Preempted
    from embodied_jax.train.runtime import ConfigError, build, prepare, validate_outputs

    try:
        if config.virtual_devices is not None:
            use_virtual_devices(config.virtual_devices)
        if config.dry_run:
            from embodied_jax.parallel import distributed
            from embodied_jax.train.dry_run import report

            distributed.initialize(config.distributed)
            config = prepare(config)  # opens the data and checks it against the model, as a real run does
            rt = build(config)
            validate_outputs(config)  # what a real run would check before writing
            report(rt, compile=config.compile, gpu_memory_gb=config.gpu_memory_gb)
            return 0
        if config.compile or config.gpu_memory_gb:
            raise ConfigError("compile: --compile and --gpu-memory-gb only apply together with --dry-run")
        from experiments.registry import runner

        return runner(config)(config)  # training, or an experiment's steps around it (the demo)
    except INPUT_ERRORS as e:
        return fail(e, verbose=config.verbose)
    except NonFiniteLossError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except Preempted as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    from embodied_jax import host_malloc

    host_malloc.reexec()  # once, before any work: malloc settings that reuse memory between steps
    sys.exit(main())
