"""The default experiment (``python -m experiments.launch`` with no name).

Interim, until the closed-loop simulation demo lands: train the toy flow-matching
policy on synthetic data on CPU and print its loss curve.
"""
from __future__ import annotations

import dataclasses

from experiments.registry import register
from experiments.toy import toy


@register("demo", "default: small end-to-end run on CPU (toy flow policy, synthetic data)")
def demo():
    base = toy()
    return dataclasses.replace(base, name="demo", workdir="runs/demo",
                               train=dataclasses.replace(base.train, steps=300, log_every=25))
