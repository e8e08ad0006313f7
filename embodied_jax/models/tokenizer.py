"""Text tokenizers loaded from local files: SentencePiece ``.model`` and HF ``tokenizer.json``.

π0.5 uses PaliGemma's SentencePiece model (``tokenizer.model``); GR00T's Eagle/Qwen3 uses a
``tokenizers`` JSON file. Both are wrapped behind one small interface (``encode`` with explicit
BOS/EOS control, ``decode``, special ids). Nothing is downloaded: a path must be given.
``train_sentencepiece`` makes a small SentencePiece model of one's own prompts (the demo's
tokenizer, the tests'), with PaliGemma's special ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids) -> str: ...


def train_sentencepiece(sentences, path: str | os.PathLike, *, vocab_size: int, model_type: str = "word") -> Path:
    """A SentencePiece model of ``sentences`` written to ``path``: pad 0, eos 1, bos 2, unk 3 (PaliGemma's
    ids), every character covered, ``vocab_size`` a ceiling (a small corpus may give fewer pieces)."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        character_coverage=1.0,
        minloglevel=2,
        hard_vocab_limit=False,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


class SentencePieceTokenizer:
    """A SentencePiece model file (PaliGemma's ``tokenizer.model`` format)."""

    def __init__(self, path: str | os.PathLike):
        import sentencepiece

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model file not found: {path}")
        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = int(self._sp.get_piece_size())
        self.bos_id = _valid_id(self._sp.bos_id())
        self.eos_id = _valid_id(self._sp.eos_id())
        pad = self._sp.pad_id()
        self.pad_id = pad if pad >= 0 else 0

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(self._sp.encode(text))
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.path}: add_bos=True but the model defines no BOS piece")
            ids.insert(0, self.bos_id)
        if add_eos:
            if self.eos_id is None:
                raise ValueError(f"{self.path}: add_eos=True but the model defines no EOS piece")
            ids.append(self.eos_id)
        return ids

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class JsonTokenizer:
    """A ``tokenizers`` library ``tokenizer.json`` file (HF fast tokenizers: Qwen3, Eagle).

    Special tokens are never added implicitly: ``encode`` calls the tokenizer with
    ``add_special_tokens=False`` and prepends/appends the named BOS/EOS only on request.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ):
        import tokenizers

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {path}")
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._token_id(bos_token)
        self.eos_id = self._token_id(eos_token)
        pad = self._token_id(pad_token)
        self.pad_id = 0 if pad is None else pad

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.path}: special token {token!r} is not in the vocabulary")
        return int(token_id)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.path}: add_bos=True but no bos_token was given")
            ids.insert(0, self.bos_id)
        if add_eos:
            if self.eos_id is None:
                raise ValueError(f"{self.path}: add_eos=True but no eos_token was given")
            ids.append(self.eos_id)
        return ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(path: str | os.PathLike, **json_kwargs) -> SentencePieceTokenizer | JsonTokenizer:
    """A tokenizer from a file, or from a directory holding ``tokenizer.model`` or ``tokenizer.json``."""
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.model", "tokenizer.json"):
            if (path / name).is_file():
                return load_tokenizer(path / name, **json_kwargs)
        raise FileNotFoundError(f"{path}: no tokenizer.model or tokenizer.json in this directory")
    if path.suffix == ".json":
        return JsonTokenizer(path, **json_kwargs)
    return SentencePieceTokenizer(path)


def _valid_id(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None
