"""``python -m embodied_jax.evaluate CKPT --task TASK``: the command line of ``embodied_jax.evaluation``
(``evaluation/cli.py``), under the name it has always had."""

import sys

from embodied_jax.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
