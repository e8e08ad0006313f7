"""Reduced π0.5 and GR00T-N1.5 (the full structure at width <= 512, 2 layers) compiled for a
virtual cluster: ``python -m tests.scale_check DEVICES`` prints one JSON line per model with
the dry-run figures at 1 example per device (fsdp = DEVICES). Used by tests/test_scale.py."""

from __future__ import annotations

import dataclasses
import json
import sys

from embodied_jax.models.pi05 import variants as pi05_variants
from embodied_jax.parallel.mesh import MeshConfig

# Widths that 64 does not divide (96, 344) and arrays narrower than 64 (32-slot embodiment
# tables, 32 action dims) exercise every placement fallback.
_FULL = pi05_variants.full()
SIGLIP = dataclasses.replace(_FULL.vision, width=96, depth=2, num_heads=4, mlp_dim=344, image_size=56)
PI05 = dataclasses.replace(
    _FULL,
    vision=SIGLIP,
    vlm=dataclasses.replace(_FULL.vlm, width=256, depth=2, mlp_dim=1024, head_dim=32),
    expert=dataclasses.replace(_FULL.expert, width=128, depth=2, mlp_dim=512, head_dim=32),
    vocab_size=2048,
    max_token_len=48,
    action_horizon=10,
    synthetic_prompt_len=16,
)


def gr00t_config():
    from experiments.gr00t import FULL_MODEL

    head = FULL_MODEL.action_head
    return dataclasses.replace(
        FULL_MODEL,
        vision=SIGLIP,
        llm=dataclasses.replace(
            FULL_MODEL.llm,
            width=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            mlp_dim=768,
            vocab_size=2048,
        ),
        select_layer=2,
        image_token_id=2047,
        max_token_len=18 + 38,
        action_head=dataclasses.replace(
            head,
            hidden_size=128,
            input_embedding_dim=192,
            max_seq_len=64,
            dit=dataclasses.replace(head.dit, num_layers=2, num_heads=4, head_dim=48, output_dim=128),
            vl_self_attention=dataclasses.replace(head.vl_self_attention, num_layers=2, num_heads=4, head_dim=64),
        ),
    )


def experiments():
    from experiments.gr00t import gr00t_n15
    from experiments.pi05 import pi05

    return {
        "pi05": dataclasses.replace(pi05(), model=PI05),
        "gr00t_n15": dataclasses.replace(gr00t_n15(), model=gr00t_config()),
    }


def measure(devices: int) -> dict[str, dict]:
    from embodied_jax.train import loop
    from embodied_jax.train.dry_run import report

    out = {}
    for name, config in experiments().items():
        config = dataclasses.replace(
            config, mesh=MeshConfig(data=1, fsdp=devices), train=dataclasses.replace(config.train, batch_size=devices)
        )
        out[name] = report(loop.build(config), compile=True, out=lambda _: None)
    return out


if __name__ == "__main__":
    from embodied_jax.parallel.virtual_devices import use_virtual_devices

    use_virtual_devices(int(sys.argv[1]))
    for name, result in measure(int(sys.argv[1])).items():
        print(json.dumps({"model": name, **result}))
