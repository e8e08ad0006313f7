"""Variable types with special meaning to the trainer.

``Fp8Meta`` holds FP8 delayed-scaling state (amax history, scales). Its "gradient" is
defined by the FP8 ops to be the variable's next value, so the train step replaces
the variable by its gradient instead of feeding it to the optimizer, and leaves it out
of gradient clipping and weight decay.
"""

from flax import nnx


class Fp8Meta(nnx.Variable):
    """FP8 scaling state, overwritten with its gradient each step."""
