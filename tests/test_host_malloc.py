"""The command lines' malloc settings: which environment gets them, and one restart with them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from embodied_jax import host_malloc


def test_tuned_environment_adds_the_settings_once_and_respects_the_users_choice():
    assert host_malloc.tuned_environment({}, glibc=True)["GLIBC_TUNABLES"] == host_malloc.REUSE
    other = host_malloc.tuned_environment({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, glibc=True)
    assert other["GLIBC_TUNABLES"] == f"glibc.pthread.rseq=0:{host_malloc.REUSE}"
    assert host_malloc.tuned_environment({"GLIBC_TUNABLES": host_malloc.REUSE}, glibc=True) is None  # restarted
    assert host_malloc.tuned_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, glibc=True) is None
    assert host_malloc.tuned_environment({"EMBODIED_JAX_MALLOC": "system"}, glibc=True) is None
    assert host_malloc.tuned_environment({}, glibc=False) is None  # musl, macOS: nothing to set


@pytest.mark.skipif(host_malloc.tuned_environment({}) is None, reason="not glibc")
def test_reexec_restarts_the_command_once_with_the_settings():
    code = (
        "import os, sys; print('start', flush=True); from embodied_jax import host_malloc; host_malloc.reexec(); "
        "print(host_malloc.mode(), sys.argv[1:])"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host_malloc.OPT_OUT)}
    run = dict(capture_output=True, text=True, check=True)
    out = subprocess.run([sys.executable, "-c", code, "a", "--b"], env=base, **run).stdout
    assert out.split("\n") == ["start", "start", "reuse ['a', '--b']", ""]  # one restart, arguments kept
    out = subprocess.run([sys.executable, "-c", code], env={**base, host_malloc.OPT_OUT: "system"}, **run).stdout
    assert out.split("\n") == ["start", "system []", ""]
