"""Conventions shared by every command line: bad input is one ``error: ...`` line and exit
status 2 (``--verbose`` adds the traceback); anything else is a bug and keeps its traceback.
``parse_flags`` is ``tyro.cli`` for every command line (the launcher, the library's tools, the
benchmarks: flags from a dataclass, defaults stated once); ``run_main`` runs one with those
conventions (``--verbose`` anywhere turns the traceback on)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence

from embodied_jax.errors import InputError
from embodied_jax.host_malloc import reexec

# Besides the project's own InputErrors: a missing or unreadable file.
INPUT_ERRORS: tuple[type[BaseException], ...] = (InputError, OSError)


def fail(exc: BaseException, *, verbose: bool) -> int:
    """Report an input error the command line way; returns the exit status (2)."""
    if verbose:
        traceback.print_exception(exc)
    print(f"error: {exc}", file=sys.stderr)
    return 2


def parse_flags(*args, **kwargs):
    """``tyro.cli(*args, **kwargs)``, parsed again (up to 3 tries) on CPython 3.11's spurious
    ``SystemError: AST constructor recursion depth mismatch``: the AST constructor keeps its recursion
    depth in state all threads share (gh-106905), and tyro reads field docstrings through
    ``inspect.getsource`` -> ``ast`` while other threads may parse too. Parsing is side-effect free."""
    import tyro

    for attempt in range(3):
        try:
            return tyro.cli(*args, **kwargs)
        except SystemError as e:
            if "AST constructor recursion depth mismatch" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def renamed_flags(argv: Sequence[str], renames: Sequence[tuple[str, str]]) -> list[str]:
    """``argv`` with each flag that starts with an old prefix spelled with the new one (``renames``:
    ``(old, new)`` pairs), and one deprecation line on stderr per prefix used."""
    out, said = [], set()
    for arg in argv:
        for old, new in renames:
            if arg.startswith(old):
                if old not in said:
                    print(f"warning: {old}* is deprecated; it is now {new}*", file=sys.stderr)
                    said.add(old)
                arg = new + arg[len(old) :]
                break
        out.append(arg)
    return out


def run_main(
    main: Callable[[list[str]], object],
    argv: Sequence[str] | None = None,
    errors: tuple[type[BaseException], ...] = INPUT_ERRORS,
) -> int:
    """Run ``main(argv)`` (a script's own argument parsing included), reporting ``errors`` in
    one line; ``--verbose`` anywhere in ``argv`` is taken out and turns the traceback on."""
    if argv is None:  # a real command line: restart once with the step-to-step malloc settings
        reexec()
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in argv
    argv = [a for a in argv if a != "--verbose"]
    try:
        main(argv)
    except errors as exc:
        return fail(exc, verbose=verbose)
    return 0
