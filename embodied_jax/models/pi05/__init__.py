"""π0.5 (openpi / LeRobot ``PI05Policy``) as a Flax NNX Policy, with prefix reuse and packing.

Architecture: SigLIP tower + linear projector embed each camera image (not scaled); Gemma token
embeddings of the prompt (which carries the discretised state, see ``inputs.py``) are scaled by
√width; together they form the prefix, attended bidirectionally (block 0). The action suffix
(``action_in_proj`` of the noisy actions, block 1) runs through the action expert, whose norms are
AdaRMS conditioned on ``silu(time_mlp_out(silu(time_mlp_in(sincos(t)))))``; the VLM and the expert
share one attention per layer (``gemma.MultiExpertGemma``). Positions count real tokens only.

Flow matching exactly as upstream: t = 0.001 + 0.999·Beta(1.5, 1); x_t = t·noise + (1-t)·actions;
target u = noise - actions; loss = mean of (v - u)² over real action dims (``action_dim_mask`` or
the first ``action_dim``), horizon and samples. ``sample_actions`` integrates from t=1 (noise) to
t=0 with ``num_steps`` Euler steps of dt = -1/num_steps: the prefix runs once into a per-layer KV
cache, each step runs the suffix only, inside ``lax.fori_loop``.

Beyond upstream:

- ``flow_samples_per_obs`` K: the prefix never attends the suffix, so training runs the prefix
  once and K (noise, time) draws per observation attend its cached keys/values (gradients reach
  the prefix from all K). ``joint_forward=True`` runs upstream's single joint pass (K must be 1);
  at K=1 both give the same loss.
- Packed rows (``data/packing.py``, the builder's ``packed=True`` form): ``tokens``,
  ``segment_ids``, ``positions`` [R, L] with image-token ids (``image_token_id``) where each
  sample's images go, ``images`` [R, I, H, W, 3] / ``image_segment_ids`` [R, I] (only the
  cameras samples have), per-sample ``actions`` [R, M, horizon, A], ``action_dim_mask``
  [R, M, A] and ``sample_mask`` [R, M]. Suffix tokens of sample m get segment m; attention
  is block-sparse over each sample's own tokens (``nn.block_sparse``), so samples never see
  each other and padding costs no attention work. Unpacked batches (the Observation
  contract) are the M = 1 case: ``token_mask``, ``image_masks``, ``actions`` [B, horizon, A].

Explicit ``noise``/``time`` may be given in the shapes [R, (K,) (M,) horizon, A] / [R, (K,) (M,)]
(K and M axes present only when > 1).
"""

from embodied_jax.models.pi05 import flops  # registers the family's FLOP count (policy.implements)
from embodied_jax.models.pi05.config import GEMMA_2B, GEMMA_300M, SIGLIP_SO400M, Pi05Config
from embodied_jax.models.pi05.model import Pi05Policy

__all__ = ["flops", "GEMMA_2B", "GEMMA_300M", "SIGLIP_SO400M", "Pi05Config", "Pi05Policy"]
