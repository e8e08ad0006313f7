"""π0.5 input builder and tokenizers: upstream's prompt, state bins, padding and image handling.

The SentencePiece model is trained on the fly (PaliGemma's special ids: pad 0, eos 1, bos 2).
"""

import numpy as np
import pytest
import sentencepiece as spm

from embodied_jax.images import resize_with_pad
from embodied_jax.models.pi05.inputs import Pi05InputBuilder, build_prompt, discretize_state
from embodied_jax.models.tokenizer import JsonTokenizer, SentencePieceTokenizer, load_tokenizer, train_sentencepiece

CORPUS = [
    "Task: pick up the red cube, State: 0 12 128 255 64 3;\nAction: ",
    "Task: open the drawer and put the spoon inside, State: 1 2 3 4 5 6 7 8 9 10;\nAction: ",
    "Task: stack the blocks, State: 99 100 101 200 201 250;\nAction: ",
] * 20


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(
        CORPUS, tmp_path_factory.mktemp("sp") / "tokenizer.model", vocab_size=48, model_type="unigram"
    )


def test_state_bins_follow_upstream():
    state = np.array([-1.0, -0.999, 0.0, 0.5, 0.999, 1.0, -1.5], np.float32)
    bins = discretize_state(state, max_state_dim=9)
    np.testing.assert_array_equal(bins, [0, 0, 128, 192, 255, 255, -1, 128, 128])
    edges = np.linspace(-1, 1, 257)[:-1]
    x = np.random.default_rng(0).uniform(-1, 1, 32)
    np.testing.assert_array_equal(discretize_state(x, 32), np.digitize(x, edges) - 1)
    with pytest.raises(ValueError, match="max_state_dim"):
        discretize_state(np.zeros(5), max_state_dim=4)


def test_prompt_format():
    prompt = build_prompt("  pick_up the\ncube ", np.array([0, 128, 255]))
    assert prompt == "Task: pick up the cube, State: 0 128 255;\nAction: "


def test_builder_tokens_images_and_actions(sp_model):
    builder = Pi05InputBuilder(
        sp_model,
        camera_names=("base", "wrist", "other"),
        image_size=(8, 8),
        max_token_len=96,
        max_state_dim=6,
        max_action_dim=5,
    )
    state = np.array([0.0, 0.5, -1.0], np.float32)
    image = np.full((4, 8, 3), 255, np.uint8)  # 4x8 -> resized to 4x8 inside 8x8, padded with -1
    out = builder(
        {
            "task": "pick_up the red cube",
            "state": state,
            "images": {"base": image},
            "actions": np.ones((3, 2), np.float32),
        }
    )
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    expected = [2] + sp.encode("Task: pick up the red cube, State: 128 192 0 128 128 128;\nAction: ")
    n = len(expected)
    assert out["tokens"].dtype == np.int32 and out["tokens"].shape == (96,)
    np.testing.assert_array_equal(out["tokens"][:n], expected)
    np.testing.assert_array_equal(out["tokens"][n:], 0)
    np.testing.assert_array_equal(out["token_mask"], np.arange(96) < n)
    assert out["image_masks"] == {"base": True, "wrist": False, "other": False}
    base = out["images"]["base"]
    assert base.shape == (8, 8, 3) and base.dtype == np.float32
    np.testing.assert_allclose(base[2:6], 1.0)  # content centred
    np.testing.assert_allclose(base[:2], -1.0)  # padding
    np.testing.assert_allclose(out["images"]["wrist"], -1.0)
    np.testing.assert_array_equal(out["actions"][:, 2:], 0)
    np.testing.assert_array_equal(out["action_dim_mask"], [True, True, False, False, False])
    np.testing.assert_array_equal(out["state"], [0.0, 0.5, -1.0, 0, 0, 0])


def test_long_prompt_is_truncated(sp_model):
    builder = Pi05InputBuilder(sp_model, camera_names=("base",), image_size=(4, 4), max_token_len=6)
    out = builder({"task": "open the drawer and put the spoon inside", "state": np.zeros(3)})
    assert out["token_mask"].all() and out["tokens"][0] == 2


def test_resize_with_pad_keeps_aspect():
    image = np.linspace(-1, 1, 6 * 12 * 3).reshape(6, 12, 3).astype(np.float32)
    out = resize_with_pad(image, 12, 12, rounding="floor")  # the builder's (openpi's) rule
    assert out.shape == (12, 12, 3)
    np.testing.assert_allclose(out[:3], -1.0)
    np.testing.assert_allclose(out[9:], -1.0)
    assert out[3:9].min() >= -1.0 and out[3:9].max() <= 1.0


def test_packed_builder_emits_image_tokens_for_present_cameras_only(sp_model):
    kwargs = dict(
        camera_names=("base", "wrist"),
        image_size=(4, 4),
        max_token_len=128,
        max_state_dim=2,
        image_tokens=3,
        image_token_id=999,
    )
    padded, packed = Pi05InputBuilder(sp_model, **kwargs), Pi05InputBuilder(sp_model, packed=True, **kwargs)
    sample = {
        "task": "stack the blocks",
        "state": np.zeros(2),
        "images": {"wrist": np.zeros((4, 4, 3), np.uint8)},
        "actions": np.zeros((2, 3)),
    }
    full, out = padded(sample), packed(sample)
    prompt = full["tokens"][full["token_mask"]]
    np.testing.assert_array_equal(out["tokens"], np.concatenate([[999] * 3, prompt]))
    assert out["images"].shape == (1, 4, 4, 3) and packed.tokens_per_image == 3
    np.testing.assert_array_equal(out["images"][0], full["images"]["wrist"])
    np.testing.assert_array_equal(out["action_dim_mask"], full["action_dim_mask"])
    assert "token_mask" not in out and "image_masks" not in out
    none = packed({**sample, "images": {}})
    np.testing.assert_array_equal(none["tokens"], prompt)
    assert none["images"].shape == (0, 4, 4, 3)


def test_sentencepiece_and_json_tokenizers(sp_model, tmp_path):
    tok = load_tokenizer(sp_model.parent)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    ids = tok.encode("stack the blocks", add_bos=True, add_eos=True)
    assert ids[0] == 2 and ids[-1] == 1 and tok.decode(ids[1:-1]) == "stack the blocks"

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "pick": 3, "up": 4, "cube": 5}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    json_tok = load_tokenizer(tmp_path, bos_token="<s>", eos_token="</s>")
    assert isinstance(json_tok, JsonTokenizer)
    assert json_tok.encode("pick up cube", add_bos=True, add_eos=True) == [1, 3, 4, 5, 2]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        JsonTokenizer(tmp_path / "tokenizer.json", bos_token="<bos>")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.model")
