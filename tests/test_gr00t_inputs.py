"""GR00T input builder: Eagle chat prompt with image-token ids from a tiny local tokenizer.json; the packed form."""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from embodied_jax.models.gr00t.inputs import Gr00tInputBuilder, eagle_prompt

WORDS = [
    "[UNK]",
    "system",
    "You",
    "are",
    "a",
    "helpful",
    "assistant",
    ".",
    "user",
    "<",
    "image",
    "1",
    "2",
    ">",
    "pick",
    "the",
    "cube",
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<|endoftext|>"]
IMG_ID = len(WORDS) + SPECIALS.index("<IMG_CONTEXT>")
PAD_ID = len(WORDS) + SPECIALS.index("<|endoftext|>")


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_prompt_text_follows_the_eagle_template():
    text = eagle_prompt("pick the cube", num_images=2, image_tokens=3)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<image 1><img><IMG_CONTEXT><IMG_CONTEXT><IMG_CONTEXT></img>"
        "<image 2><img><IMG_CONTEXT><IMG_CONTEXT><IMG_CONTEXT></img>"
        "pick the cube<|im_end|>\n<|im_start|>assistant\n"
    )


def test_builder_tokenizes_pads_and_pads_state_and_actions(tokenizer_path):
    builder = Gr00tInputBuilder(
        tokenizer_path,
        camera_names=("front", "wrist"),
        image_tokens=4,
        image_token_id=IMG_ID,
        max_token_len=64,
        max_state_dim=6,
        action_dim=5,
    )
    sample = {
        "task": " pick the cube ",
        "state": [0.5, -1.0, 2.0],
        "images": {"front": np.zeros((28, 28, 3), np.uint8), "wrist": np.full((28, 28, 3), 255, np.uint8)},
        "actions": np.ones((3, 4), np.float32),
    }
    out = builder(sample)
    tokens, mask = out["tokens"], out["token_mask"]
    n = int(mask.sum())
    assert mask[:n].all() and not mask[n:].any()
    assert (tokens[n:] == PAD_ID).all()
    assert int((tokens == IMG_ID).sum()) == 8
    vocab = {i: w for i, w in enumerate(WORDS + SPECIALS)}
    words = [vocab[int(t)] for t in tokens[:n]]
    assert words[:2] == ["<|im_start|>", "system"] and words[-3:] == ["<|im_end|>", "<|im_start|>", "assistant"]
    assert words[words.index("</img>", words.index("</img>") + 1) + 1 :][:3] == ["pick", "the", "cube"]
    np.testing.assert_array_equal(out["state"], [0.5, -1.0, 2.0, 0, 0, 0])
    assert out["actions"].shape == (3, 5) and out["action_mask"][:, :4].all() and not out["action_mask"][:, 4].any()
    assert out["images"]["front"].min() == -1.0 and out["images"]["wrist"].max() == 1.0
    assert int(out["embodiment_id"]) == 31

    with pytest.raises(ValueError, match="image_token_id"):
        Gr00tInputBuilder(tokenizer_path, image_token_id=IMG_ID + 1)
    with pytest.raises(ValueError, match="max_token_len"):
        Gr00tInputBuilder(tokenizer_path, image_tokens=4, image_token_id=IMG_ID, max_token_len=10)(
            {**sample, "images": {"ego_view": sample["images"]["front"]}}
        )
    with pytest.raises(KeyError, match="wrist"):
        builder({**sample, "images": {"front": sample["images"]["front"]}})


def test_packed_builder_emits_only_the_cameras_a_sample_has(tokenizer_path):
    kwargs = dict(
        camera_names=("front", "wrist"),
        image_tokens=4,
        image_token_id=IMG_ID,
        max_token_len=64,
        max_state_dim=6,
        action_dim=5,
    )
    padded, packed = (
        Gr00tInputBuilder(tokenizer_path, **kwargs),
        Gr00tInputBuilder(tokenizer_path, packed=True, **kwargs),
    )
    both = {"front": np.zeros((28, 28, 3), np.uint8), "wrist": np.full((28, 28, 3), 255, np.uint8)}
    sample = {"task": "pick the cube", "state": [0.5], "images": both, "actions": np.ones((3, 4), np.float32)}
    full = padded(sample)
    out = packed(sample)
    np.testing.assert_array_equal(out["tokens"], full["tokens"][full["token_mask"]])  # unpadded, same ids
    assert out["images"].shape == (2, 28, 28, 3) and "token_mask" not in out and "image_masks" not in out
    one = packed({**sample, "images": {"wrist": both["wrist"]}})
    assert int((one["tokens"] == IMG_ID).sum()) == 4 and one["images"].shape == (1, 28, 28, 3)
    assert one["images"].max() == 1.0 and len(one["tokens"]) < len(out["tokens"])
    assert packed.tokens_per_image == 4
    with pytest.raises(KeyError, match="wrist"):
        padded({**sample, "images": {"front": both["front"]}})
    with pytest.raises(KeyError, match="not in cameras"):
        packed({**sample, "images": {"top": both["front"]}})
