"""Finding a trace's checkpoint by `weights_sha256` in `REPLAY_AUDIT_MODEL_DIRS`, and what
bounds the work on it (`CheckpointShape`: vocabulary, context, tokenizer; no torch)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tokenizers import Tokenizer

from replay_audit.engine.hashing import weights_sha256 as checkpoint_sha256


def candidate_dirs(model_dirs: Sequence[Path]) -> Iterator[Path]:
    """Each listed directory that holds `*.safetensors` itself, else each of its immediate
    subdirectories that does (so `/models` can hold one checkpoint per subdirectory)."""
    for root in model_dirs:
        if not root.is_dir():
            continue
        if any(root.glob("*.safetensors")):
            yield root
            continue
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            if any(sub.glob("*.safetensors")):
                yield sub


class ModelNotFound(LookupError):
    pass


def find_checkpoint(weights_sha256: str, model_dirs: Sequence[Path]) -> Path:
    """The checkpoint directory whose weights hash is `weights_sha256`.

    Each file's digest is kept while it keeps its path, inode, size and mtime
    (`engine.hashing`), so only the first lookup reads the weights. Raises `ModelNotFound`
    naming the directories searched.
    """
    for d in candidate_dirs(model_dirs):
        if checkpoint_sha256(d) == weights_sha256:
            return d
    searched = ", ".join(str(p) for p in model_dirs) or "(none)"
    raise ModelNotFound(
        f"no checkpoint with weights_sha256 {weights_sha256} in REPLAY_AUDIT_MODEL_DIRS "
        f"({searched})"
    )


#: config.json keys of a model's context length, by model family (Llama and most: the first).
_CONTEXT_KEYS: Final = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
)


@dataclass(frozen=True)
class CheckpointShape:
    """What bounds a request's work on a checkpoint, read from its `config.json` and
    `tokenizer.json` (torch-free: the API reads it): the vocabulary size, the context length,
    and the tokenizer, if the directory has one."""

    path: Path
    vocab_size: int
    context: int
    tokenizer: Tokenizer | None
    #: Most UTF-8 bytes of text one token can stand for (its longest piece's, four times that
    #: behind a normaliser, which may shorten the text): a text has at least its length over
    #: this many tokens, known without tokenizing it.
    bytes_per_token: int = 1

    @classmethod
    def read(cls, model_dir: Path) -> CheckpointShape:
        """`ModelNotFound` when `config.json` lacks a vocabulary size or a context length, or
        `tokenizer.json` cannot be read."""
        path = model_dir / "tokenizer.json"
        try:
            config = json.loads((model_dir / "config.json").read_text())
            config = config.get("text_config", config)  # a multimodal checkpoint's language model
            context = next(int(config[k]) for k in _CONTEXT_KEYS if k in config)
            vocab_size = int(config["vocab_size"])
            tok = Tokenizer.from_file(str(path)) if path.is_file() else None
        except Exception:  # tokenizers raises plain Exception; json, int and next their own
            raise ModelNotFound(
                f"{model_dir.name}: no config.json with vocab_size and a context length "
                f"({', '.join(_CONTEXT_KEYS)}), or a tokenizer.json that does not load"
            ) from None
        longest = max((len(p.encode()) for p in tok.get_vocab(True)), default=1) if tok else 1
        shrink = 4 if tok is not None and tok.normalizer is not None else 1
        return cls(model_dir, vocab_size, context, tok, max(1, longest * shrink))

    def prompt_refusal(self, ids: Sequence[int], max_new_tokens: int) -> str | None:
        """Why a prompt of these token ids cannot be decoded `max_new_tokens` more on this
        checkpoint (an id outside the vocabulary, past the context), or None."""
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})"
        if len(ids) + max_new_tokens > self.context:
            return (
                f"{len(ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed the "
                f"checkpoint's context of {self.context} tokens"
            )
        return None


class CheckpointIndex:
    """The checkpoints of `REPLAY_AUDIT_MODEL_DIRS` found by `weights_sha256` (each hashed once
    while its files are unchanged) and their `CheckpointShape`, read once each. Torch-free and
    thread-safe: the API holds one."""

    def __init__(self, model_dirs: Sequence[Path]) -> None:
        self.model_dirs = list(model_dirs)
        self._shapes: dict[tuple[Path, int], CheckpointShape] = {}

    def shape(self, weights_sha256: str) -> CheckpointShape:
        """The shape of the checkpoint whose weights hash is `weights_sha256`; `ModelNotFound`
        when no directory holds it or its config.json says too little."""
        d = find_checkpoint(weights_sha256, self.model_dirs)
        config = d / "config.json"
        key = (d, config.stat().st_mtime_ns if config.is_file() else 0)
        if key not in self._shapes:
            self._shapes[key] = CheckpointShape.read(d)
        return self._shapes[key]
