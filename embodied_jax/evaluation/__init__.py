"""Closed-loop evaluation of policies, in one place:

- ``closed_loop.py``: the library entry (``evaluate_policy`` for MJX tasks, ``evaluate_metaworld``
  for Meta-World by LeRobot's protocol) and its report lines, which the command line, the demo,
  the Meta-World experiments and the benchmarks call;
- ``cli.py``: ``python -m embodied_jax.evaluate`` (flags by tyro, ``--record``);
- ``in_training.py``: the ``ExperimentConfig.evaluation`` configs the trainer runs during training
  (``SimEvaluation``, ``MetaWorldEvaluation``).

The simulators' own episode loops stay with their simulators: ``sim/closed_loop.py`` (batched MJX
in one jitted program) and ``sim/metaworld/closed_loop.py`` (Meta-World's environments stepped on
the host, one batched policy call per decision).
"""
