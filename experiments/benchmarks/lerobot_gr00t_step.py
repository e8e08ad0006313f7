"""LeRobot's GR00T-N1.5 training step at the ``gr00t_bench`` sizes, timed in PyTorch on this machine.

Comparing with LeRobot by scaling its recorded step times by a matmul rate is indirect; this script
measures LeRobot itself on the same CPU, in the same sitting as ``train_step gr00t_bench``.
It is not part of the project's environment (no torch in the core install): run it as a
script with the Python of a separate virtual environment, e.g.

    python -m venv /tmp/lerobot && P=/tmp/lerobot/bin/pip
    $P install torch==2.13.0                         # a CPU build; lerobot 0.4.4 pins torch<2.11:
    $P download --no-deps lerobot==0.4.4 -d /tmp/w && $P install --no-deps /tmp/w/lerobot-0.4.4-*.whl
    $P install torch==2.13.0 "transformers==4.57.*" "huggingface-hub>=0.34.2,<0.36" peft dm-tree \\
        einops "draccus==0.10.0" safetensors pillow "packaging<26" termcolor "diffusers<0.36" \\
        "datasets>=4,<5" "imageio<3" "jsonlines<5" "deepdiff>=7.0.1,<9" "gymnasium>=1.1.1,<2" \\
        "pyserial<4" "av>=15,<16"
    /tmp/lerobot/bin/python experiments/benchmarks/lerobot_gr00t_step.py --variant frozen

Nothing comes from the hub: the model is ``GR00TN15(GR00TN15Config(...))`` with random weights,
float32, the Eagle ``config.json`` written where LeRobot's ``EagleBackbone`` reads it (under
``--home``), the ``tune_*`` switches applied as ``GR00TN15.from_pretrained`` applies them. Eagle
asks for flash-attention-2 (GPU only); both its towers get PyTorch's ``sdpa`` instead. lerobot
imports torchvision at module level (its datasets) but the GR00T step never calls it, and no
torchvision build imports beside that torch: a stand-in whose every object raises on use is
registered instead, so a step that needed it would fail, not run differently.

The step is lerobot's trainer's: ``policy.forward`` -> backward -> global-norm clip -> AdamW
(upstream's finetune settings) -> ``zero_grad``; the batch is ``Gr00tConfig.synthetic_batch``'s
layout (one 224² camera, <img> + 256 image tokens + </img> and 24-38 text tokens in 296). It is
LeRobot's step as it runs, work the port does not do included: SigLIP's pooling head and the
LLM's vocabulary logits are computed and not read, the adapter and the DiT attend padding. The
last line is JSON: ``median_step_s`` and the float32 matmul rate of PyTorch in this process
(``matmul_flops_per_s``: median of 7 3464x512 @ 512x2048 matmuls, before and after the steps).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

# The sizes of experiments/gr00t.py BENCH_MODEL (tests/test_benchmarks.py holds them equal).
IMAGE_TOKEN_ID = 2047
MAX_TOKEN_LEN = 258 + 38
TEXT_TOKENS = (24, 38)
BATCH_SIZE = 4
IMAGE_SIZE, PATCH_SIZE = 224, 14
VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4)
LLM = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=2048,
)
SELECT_LAYER = 4
ACTION_HEAD = dict(
    hidden_size=256,
    input_embedding_dim=256,
    max_num_embodiments=32,
    num_target_vision_tokens=32,
    action_dim=32,
    action_horizon=16,
    max_state_dim=64,
)
DIT = dict(num_layers=4, num_attention_heads=8, attention_head_dim=32, output_dim=256)
VL_SELF_ATTENTION = dict(num_layers=1, num_attention_heads=8, attention_head_dim=64)
# upstream finetune optimiser (as experiments/gr00t.py)
ADAMW = dict(lr=1e-4, betas=(0.95, 0.999), eps=1e-8, weight_decay=1e-5)


def eagle_config() -> dict:
    """Eagle 2.5's config.json at the BENCH sizes: 256 image tokens per image (no pixel shuffle, as N1.5)."""
    return {
        "architectures": ["Eagle25VLForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_eagle2_5_vl.Eagle25VLConfig",
            "AutoModel": "modeling_eagle2_5_vl.Eagle25VLForConditionalGeneration",
        },
        "model_type": "eagle_2_5_vl",
        "vision_config": dict(
            VISION,
            model_type="siglip_vision_model",
            patch_size=PATCH_SIZE,
            image_size=IMAGE_SIZE,
            num_channels=3,
            hidden_act="gelu_pytorch_tanh",
            layer_norm_eps=1e-6,
            attention_dropout=0.0,
        ),
        "text_config": dict(
            LLM,
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            hidden_act="silu",
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
            attention_bias=False,
            attention_dropout=0.0,
            tie_word_embeddings=True,
            use_cache=False,
            torch_dtype="float32",
        ),
        "select_layer": -1,
        "force_image_size": IMAGE_SIZE,
        "downsample_ratio": 0.5,
        "use_pixel_shuffle": False,
        "mlp_connector_layers": 1,
        "image_token_index": IMAGE_TOKEN_ID,
        "use_backbone_lora": 0,
        "use_llm_lora": 0,
        "mlp_checkpoint": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "_attn_implementation": "sdpa",
    }


def groot_config(trainable: bool) -> dict:
    width = LLM["hidden_size"]
    head = ACTION_HEAD
    return {
        "action_dim": head["action_dim"],
        "action_horizon": head["action_horizon"],
        "compute_dtype": "float32",
        "backbone_cfg": {
            "tune_llm": trainable,
            "tune_visual": trainable,
            "select_layer": SELECT_LAYER,
            "reproject_vision": False,
            "use_flash_attention": False,
            "load_bf16": False,
            "project_to_dim": None,
        },
        "action_head_cfg": dict(
            head,
            max_action_dim=head["action_dim"],
            add_pos_embed=True,
            backbone_embedding_dim=width,
            max_seq_len=1024,
            model_dtype="float32",
            noise_beta_alpha=1.5,
            noise_beta_beta=1.0,
            noise_s=0.999,
            num_inference_timesteps=4,
            num_timestep_buckets=1000,
            tune_diffusion_model=True,
            tune_projector=True,
            use_vlln=True,
            diffusion_model_cfg=dict(
                DIT,
                cross_attention_dim=width,
                dropout=0.2,
                final_dropout=True,
                interleave_self_attention=True,
                norm_type="ada_norm",
                positional_embeddings=None,
            ),
            vl_self_attention_cfg=dict(VL_SELF_ATTENTION, dropout=0.2, final_dropout=True, positional_embeddings=None),
        ),
    }


class _Unusable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stand-in used: {type(self).__name__}")


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``torchvision[.x]`` import gives a module whose every public name is an unusable class."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stand-in"

        def missing(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (_Unusable,), {"__module__": spec.name})

        module.__getattr__ = missing
        return module

    def exec_module(self, module):
        pass


def build_policy(trainable: bool, home: Path):
    import torch
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.groot.configuration_groot import GrootConfig
    from lerobot.policies.groot.groot_n1 import GR00TN15, GR00TN15Config
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from transformers.models.siglip import modeling_siglip

    eagle_dir = home / "lerobot" / "eagle2hg-processor-groot-n1p5"
    eagle_dir.mkdir(parents=True, exist_ok=True)
    (eagle_dir / "config.json").write_text(json.dumps(eagle_config(), indent=1))

    vision_init = modeling_siglip.SiglipVisionModel.__init__

    def sdpa_vision(self, config, *args, **kwargs):  # Eagle hard-codes flash-attention-2 for its vision tower
        if getattr(config, "_attn_implementation", None) == "flash_attention_2":
            config._attn_implementation = "sdpa"
        vision_init(self, config, *args, **kwargs)

    modeling_siglip.SiglipVisionModel.__init__ = sdpa_vision

    def random_model(policy):  # GR00TN15.from_pretrained without the download and the weights
        model = GR00TN15(GR00TN15Config(**groot_config(trainable)), local_model_path=None)
        model.backbone.set_trainable_parameters(tune_visual=trainable, tune_llm=trainable)
        model.action_head.set_trainable_parameters(tune_projector=True, tune_diffusion_model=True)
        return model

    GrootPolicy._create_groot_model = random_model
    camera = PolicyFeature(type=FeatureType.VISUAL, shape=(3, IMAGE_SIZE, IMAGE_SIZE))
    config = GrootConfig(
        base_model_path="random weights (BENCH sizes)",
        device="cpu",
        use_bf16=False,
        chunk_size=ACTION_HEAD["action_horizon"],
        n_action_steps=ACTION_HEAD["action_horizon"],
        input_features={"observation.images.ego_view": camera},
        tune_visual=trainable,
        tune_llm=trainable,
        tune_projector=True,
        tune_diffusion_model=True,
    )
    return GrootPolicy(config).to(device="cpu", dtype=torch.float32)


def synthetic_batch(seed: int) -> dict:
    """``Gr00tConfig.synthetic_batch``'s layout: text before and after <img> + image tokens + </img>,
    right-padded to ``MAX_TOKEN_LEN``."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    tokens = np.zeros((BATCH_SIZE, MAX_TOKEN_LEN), np.int64)
    mask = np.zeros_like(tokens)
    for i in range(BATCH_SIZE):
        text = int(rng.integers(TEXT_TOKENS[0], TEXT_TOKENS[1] + 1))
        before = min(text // 2, 16)
        row = np.concatenate(
            [
                rng.integers(0, IMAGE_TOKEN_ID, before + 1),  # text, then the <img> marker
                np.full(patches, IMAGE_TOKEN_ID),
                rng.integers(0, IMAGE_TOKEN_ID, text - before + 1),  # </img>, then text
            ]
        )
        tokens[i, : len(row)], mask[i, : len(row)] = row, 1
    head = ACTION_HEAD

    def as_tensor(x):
        return torch.from_numpy(np.asarray(x))

    return {
        "eagle_input_ids": as_tensor(tokens),
        "eagle_attention_mask": as_tensor(mask),
        "eagle_pixel_values": as_tensor(rng.uniform(-1, 1, (BATCH_SIZE, 3, IMAGE_SIZE, IMAGE_SIZE)).astype("float32")),
        "eagle_image_sizes": torch.tensor([[IMAGE_SIZE, IMAGE_SIZE]] * BATCH_SIZE),
        "state": as_tensor(rng.normal(size=(BATCH_SIZE, 1, head["max_state_dim"])).astype("float32")),
        "state_mask": torch.ones(BATCH_SIZE, 1, head["max_state_dim"], dtype=torch.bool),
        "action": as_tensor(
            rng.normal(size=(BATCH_SIZE, head["action_horizon"], head["action_dim"])).astype("float32")
        ),
        "action_mask": torch.ones(BATCH_SIZE, head["action_horizon"], head["action_dim"]),
        "embodiment_id": as_tensor(rng.integers(0, head["max_num_embodiments"], BATCH_SIZE)),
    }


def matmul_rate(repeats: int = 7) -> float:
    import torch

    m, k, n = 3464, 512, 2048
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("frozen", "trainable"), default="frozen")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--home", default=None, help="LeRobot's cache directory (default: a temporary one)")
    args = parser.parse_args(argv)
    home = Path(args.home or tempfile.mkdtemp(prefix="lerobot_home_"))
    os.environ["HF_LEROBOT_HOME"] = str(home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.meta_path.insert(0, _StandIn())
    # run as a script, this folder leads sys.path and its profile.py would shadow the standard one
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]

    import torch
    from lerobot.optim.optimizers import AdamWConfig

    torch.manual_seed(args.seed)
    torch.distributions.Distribution.set_default_validate_args(False)
    policy = build_policy(args.variant == "trainable", home)
    policy.train()
    optimizer = AdamWConfig(**ADAMW, grad_clip_norm=args.clip_norm).build(policy.get_optim_params())
    batch = synthetic_batch(args.seed)
    rate_before = matmul_rate()
    times = []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        loss, _ = policy.forward(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args.clip_norm)
        optimizer.step()
        optimizer.zero_grad()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    rate_after = matmul_rate()
    result = {
        "benchmark": "lerobot_gr00t_step",
        "variant": args.variant,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "median_step_s": statistics.median(times),
        "step_s": times,
        "loss": float(loss.detach()),
        "params": sum(p.numel() for p in policy.parameters()),
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "matmul_flops_per_s": max(rate_before, rate_after),
        "matmul_flops_per_s_before_after": [rate_before, rate_after],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()  # runs in a separate torch environment: no jax, no project imports (nothing to --record with)
