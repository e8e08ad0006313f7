"""π0.5's prompt, defined once: ``BOS + "Task: {task}, State: {b_0} ... {b_{D-1}};\\nAction: "``
(openpi's and LeRobot's), the state's bins from ``np.digitize(normalised, edges) - 1``.

The host builder (``models/pi05/inputs.py``) formats and encodes it per sample
(``build_prompt``, ``tokenize_prompt``); the in-program form assembles the same tokens per row from
token tables of the same pieces, made once per instruction on the host (``Pi05Prompt``): a fixed
head and, for every state bin, that bin's tokens (between bins, and as the last one with the
prompt's tail), compacted in the program with a cumulative sum, truncated and padded to
``max_token_len`` as the host does; the bins are counted against per-dimension thresholds on the
raw state that reproduce the host's float64 normalisation exactly. ``Pi05Prompt.verify`` checks
the assembly against the builder's own tokens for probe states; a tokenizer that merges text
across the pieces (SentencePiece joins consecutive unknown words into one ``<unk>``) fails it, and
then the tokens come from the host (``host_prompt_tokens``, through ``jax.pure_callback``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.models.in_program import pad_state
from embodied_jax.policy import RowTransform

# The prompt's three pieces: the head (after BOS), one per state bin, the tail after the last bin.
HEAD = "Task: {task}, State:"
BIN = " {bin}"
TAIL = ";\nAction: "
_CONTEXT = HEAD.rsplit(" ", 1)[-1]  # the head's last word: what a bin's tokens follow


def clean_task(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def state_edges(num_bins: int) -> np.ndarray:
    """The bins' lower edges on the normalised state: ``linspace(-1, 1, num_bins + 1)[:-1]``."""
    return np.linspace(-1.0, 1.0, num_bins + 1)[:-1]


def discretize_state(state: np.ndarray, max_state_dim: int = 32, num_bins: int = 256) -> np.ndarray:
    """Zero-pad the normalised state to ``max_state_dim`` and map it to bins 0..num_bins-1 (upstream
    rule; values below -1 give -1)."""
    state = np.asarray(state, np.float32).reshape(-1)
    if state.shape[0] > max_state_dim:
        raise ValueError(f"state has {state.shape[0]} dims, more than max_state_dim={max_state_dim}")
    state = np.pad(state, (0, max_state_dim - state.shape[0]))
    return (np.digitize(state, bins=state_edges(num_bins)) - 1).astype(np.int64)


def build_prompt(task: str, state_bins: np.ndarray) -> str:
    """The π0.5 prompt with discrete state tokens."""
    bins = "".join(BIN.format(bin=b) for b in np.asarray(state_bins).tolist())
    return HEAD.format(task=clean_task(task)) + bins + TAIL


def tokenize_prompt(tokenizer, prompt: str, max_token_len: int) -> tuple[np.ndarray, np.ndarray]:
    """BOS + prompt, truncated to and right-padded to ``max_token_len``: (tokens int32, mask bool)."""
    ids = tokenizer.encode(prompt, add_bos=True)[:max_token_len]
    tokens = np.full((max_token_len,), tokenizer.pad_id, np.int32)
    tokens[: len(ids)] = ids
    mask = np.zeros((max_token_len,), bool)
    mask[: len(ids)] = True
    return tokens, mask


def host_prompt_tokens(builder, instruction: str, front: RowTransform):
    """The fallback: π0.5's prompt tokens of raw states [..., S], normalised and tokenised by the
    run's own transform and builder on the host."""
    length = builder.max_token_len

    def host(states):
        states = np.asarray(states, np.float32)
        rows = [
            builder({"task": instruction, "state": front.host_state(s)}) for s in states.reshape(-1, states.shape[-1])
        ]
        tokens = np.stack([r["tokens"] for r in rows]).astype(np.int32).reshape(*states.shape[:-1], length)
        mask = np.stack([r["token_mask"] for r in rows]).astype(bool).reshape(*states.shape[:-1], length)
        return tokens, mask

    def tokens(states):
        lead = states.shape[:-1]
        spec = (jax.ShapeDtypeStruct((*lead, length), jnp.int32), jax.ShapeDtypeStruct((*lead, length), jnp.bool_))
        return jax.pure_callback(host, spec, jnp.asarray(states, jnp.float32), vmap_method="expand_dims")

    return tokens


@dataclasses.dataclass(frozen=True)
class Pi05Prompt:
    """π0.5's ``BOS + "Task: {task}, State: {b_0} ... {b_{D-1}};\\nAction: "`` as token tables:
    ``head`` [Lh] the BOS and text before the first bin; ``pieces`` [2, num_bins + 1, W] (with
    ``lengths``) the tokens of ``" {b}"`` between bins (0) and of ``" {b};\\nAction: "`` as the
    last (1), for b = -1 .. num_bins - 1 (a normalised value below -1 discretises to -1).

    The bins are counted on the raw state: ``thresholds`` [S or 1, num_bins] holds, per state
    dimension and bin edge, the smallest float32 raw value that the host's normalisation (float64,
    rounded once) puts on or above the edge, so the bins equal the host's exactly (a float32
    normalisation in the program would move values that lie within rounding of an edge).
    ``padded_bin``: the bin of the zeros padding the state to ``max_state_dim``. Built once per
    instruction on the host."""

    head: np.ndarray
    pieces: np.ndarray
    lengths: np.ndarray
    thresholds: np.ndarray
    padded_bin: int
    max_state_dim: int
    max_token_len: int
    pad_id: int

    @classmethod
    def build(cls, builder, instruction: str, front: RowTransform) -> Pi05Prompt:
        tokenizer = builder.tokenizer
        head = tokenizer.encode(HEAD.format(task=clean_task(instruction)), add_bos=True)
        context = tokenizer.encode(_CONTEXT)
        bins = range(-1, builder.state_bins)
        tails = ("", TAIL)
        pieces = [[_in_context(tokenizer, _CONTEXT, context, BIN.format(bin=b) + tail) for b in bins] for tail in tails]
        widest = max(len(p) for table in pieces for p in table)
        table = np.full((2, len(bins), max(widest, 1)), tokenizer.pad_id, np.int32)
        lengths = np.zeros((2, len(bins)), np.int32)
        for i, row in enumerate(pieces):
            for j, ids in enumerate(row):
                table[i, j, : len(ids)] = ids
                lengths[i, j] = len(ids)
        edges = state_edges(builder.state_bins).astype(np.float32)  # exact in float32
        return cls(
            head=np.asarray(head, np.int32),
            pieces=table,
            lengths=lengths,
            thresholds=front.thresholds(edges),
            padded_bin=int(np.sum(np.float32(0.0) >= edges)) - 1,
            max_state_dim=int(builder.max_state_dim),
            max_token_len=int(builder.max_token_len),
            pad_id=int(tokenizer.pad_id),
        )

    def bins(self, raw_state: jax.Array) -> jax.Array:
        """The builder's ``np.digitize(normalised, edges) - 1`` of one raw state [S], padded to
        ``max_state_dim`` (a NaN: the last bin, where NumPy sorts it)."""
        raw_state = jnp.asarray(raw_state, jnp.float32)
        count = jnp.sum(raw_state[:, None] >= jnp.asarray(self.thresholds), axis=-1)
        bins = jnp.where(jnp.isnan(raw_state), self.thresholds.shape[-1], count).astype(jnp.int32) - 1
        return pad_state(bins, self.max_state_dim, self.padded_bin)

    def tokens(self, raw_state: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(tokens int32 [L], token_mask bool [L]) of one raw state [S]."""
        index = self.bins(raw_state) + 1  # row of the tables: bin -1 is row 0
        last = (jnp.arange(index.shape[0]) == index.shape[0] - 1).astype(jnp.int32)
        table, lengths = jnp.asarray(self.pieces), jnp.asarray(self.lengths)
        pieces = table[last, index]  # [D, W]
        valid = jnp.arange(table.shape[-1])[None, :] < lengths[last, index][:, None]
        flat = jnp.concatenate([jnp.asarray(self.head), pieces.reshape(-1)])
        keep = jnp.concatenate([jnp.ones(len(self.head), bool), valid.reshape(-1)])
        count = jnp.cumsum(keep.astype(jnp.int32))  # compaction: output j is the (j+1)-th kept token
        positions = jnp.arange(self.max_token_len)
        source = jnp.searchsorted(count, positions + 1, side="left")
        mask = positions < count[-1]  # truncated to max_token_len by the fixed output length
        tokens = jnp.where(mask, flat[jnp.minimum(source, flat.shape[0] - 1)], self.pad_id)
        return tokens.astype(jnp.int32), mask

    def verify(self, builder, instruction: str, front: RowTransform) -> bool:
        """Whether the assembly equals the builder's own tokens (after the host's normalisation)
        for probe raw states: normalised every bin 0, every bin 255, every bin -1 (where the
        normalisation reaches it), a seeded random mix, and values on and just below edges."""
        rng = np.random.default_rng(0)
        width = self.thresholds.shape[0] if front.state_dim is None else front.state_dim
        normalised = [np.full(width, -1.0), np.full(width, 1.0), np.full(width, -1.5), rng.uniform(-1.05, 1.05, width)]
        probes = [front.host_raw_state(np.asarray(n, np.float32)) for n in normalised]
        thresholds = np.broadcast_to(self.thresholds, (width, self.thresholds.shape[-1]))
        for _ in range(2):  # on an edge, and the float32 value below it
            on = thresholds[np.arange(width), rng.integers(0, thresholds.shape[-1], width)]
            probes += [on, np.nextafter(on, np.float32(-np.inf))]
        probes = np.stack([np.nan_to_num(p, posinf=3e38, neginf=-3e38) for p in probes]).astype(np.float32)
        got_tokens, got_mask = jax.jit(jax.vmap(self.tokens))(probes)
        for probe, tokens, mask in zip(probes, np.asarray(got_tokens), np.asarray(got_mask), strict=True):
            want = builder({"task": instruction, "state": front.host_state(probe)})
            if not (np.array_equal(want["tokens"], tokens) and np.array_equal(want["token_mask"], mask)):
                return False
        return True


def _in_context(tokenizer, context: str, context_ids: list[int], piece: str) -> list[int]:
    """The tokens ``piece`` adds after ``context`` (so a tokenizer's start-of-text handling does not
    apply to it); a tokenizer that re-tokenises the context around it gets the bare piece's, which
    the probe check then refuses."""
    ids = tokenizer.encode(context + piece)
    if ids[: len(context_ids)] == context_ids:
        return ids[len(context_ids) :]
    return tokenizer.encode(piece)
