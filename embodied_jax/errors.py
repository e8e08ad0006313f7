"""The base of every error that means bad input (a flag, a file, a dataset, an observation).

Each part of the library raises its own named error (``DatasetError``, ``ConfigError``, ...);
all of them also derive from ``InputError``, so a command line reports any of them in one line
(``embodied_jax.cli``) while a bug still shows its traceback. The two errors below are raised
on both sides of the model/bundle boundary (a bundle's checks and a model family's in-program
input form), so they live here.
"""

from __future__ import annotations


class InputError(Exception):
    """Raised for input the user can fix; the message names what is wrong and what was expected."""


class ObservationError(InputError, ValueError):
    """A robot observation the policy cannot take (missing key, shape, dtype, non-finite state)."""


class DeviceIOError(InputError, ValueError):
    """A bundle (or an observation's layout) that the in-program processing cannot express."""
