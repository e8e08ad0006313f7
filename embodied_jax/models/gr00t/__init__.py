"""GR00T-N1.5 policy: config, flow-matching loss and sampling, freezing (the attention layout of
unpacked and packed batches: ``layout.py``).

``Gr00tPolicy`` = ``backbone`` (Eagle 2.5: SigLIP + ``mlp1`` + truncated Qwen3) and
``action_head`` (VL LayerNorm + adapter, embodiment-specific encoders/decoder, DiT).

Flow matching as upstream: t = (s - Beta(a, b)) / s with (a, b) = ``time_beta`` = (1.5, 1) and
s = ``time_scale`` = 0.999 (t = 0 noise, t = 1 data), x_t = (1 - t) noise + t actions,
target = actions - noise, timestep bucket floor(1000 t) for the DiT and the action encoder,
MSE masked by ``action_mask``.
Sampling: backbone + adapter once, K Euler steps (bucket int(k / K * 1000)) of the DiT.

Batch (DESIGN.md observation + training keys):
  ``images`` {camera: [B, H, W, 3] in [-1, 1]} (cameras in ``Gr00tConfig.camera_names`` order),
  ``tokens`` int32 [B, L], ``token_mask`` bool [B, L] (the prompt from ``inputs.py``),
  ``state`` [B, max_state_dim], ``embodiment_id`` int32 [B], ``actions`` [B, horizon,
  action_dim], ``action_mask`` [B, horizon, action_dim] (optional; all ones).
Packed rows (``data/packing.py``, ``mask_vl_padding=True`` only): ``tokens``, ``segment_ids``,
``positions`` [R, L] hold up to M samples per row (each sample's own cameras only),
``images`` [R, I, H, W, 3] with ``image_segment_ids`` [R, I], and the per-sample values
``state``, ``actions``, ``action_mask``, ``embodiment_id`` stacked [R, M, ...] with
``sample_mask`` [R, M]. The action head runs on the R·M sample slots (empty ones carry no
loss); the LLM and the adapter use block-sparse attention within each sample's segment and
the DiT cross-attends only a window of ``max_token_len`` tokens at its sample's segment.

``image_masks`` are not used: upstream GR00T has no missing-camera masking (every camera's
image-context tokens are filled from its image).

``mask_vl_padding=False`` reproduces upstream exactly: the LLM masks padded keys (padded
query rows still attend the real tokens before them, as HF does) while the VL adapter and
the DiT cross-attention attend every VL token, padding included.
"""

from embodied_jax.models.gr00t import flops  # registers the family's FLOP count (policy.implements)
from embodied_jax.models.gr00t.config import Gr00tConfig, freeze_regexes
from embodied_jax.models.gr00t.model import Gr00tPolicy

__all__ = ["flops", "Gr00tConfig", "Gr00tPolicy", "freeze_regexes"]
