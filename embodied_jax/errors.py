"""The base of every error that means bad input (a flag, a file, a dataset, an observation).

Each part of the library raises its own named error (``DatasetError``, ``ConfigError``, ...);
all of them also derive from ``InputError``, so a command line reports any of them in one line
(``embodied_jax.cli``) while a bug still shows its traceback.
"""

from __future__ import annotations


class InputError(Exception):
    """Raised for input the user can fix; the message names what is wrong and what was expected."""
