"""Token ids of logs that carry text, read with the checkpoint's tokenizer.

Many logs carry no ids: vLLM before `return_token_ids` (0.10.2) or requests without it, other
OpenAI-compatible servers, the OpenAI API, SGLang's prompt under its default
`logprob_start_len=-1`. And a top-k is often keyed by token text (vLLM without
`return_tokens_as_token_ids`, OpenAI). `resolve` fills what is missing, in this order of trust:

- output ids from the logged per-token pieces (`logprobs.content[].bytes`/`token`, SGLang's
  tuples), each mapped to the one vocabulary token whose piece it is: a model may emit a split
  that re-tokenising the text would not give back, and the pieces keep it;
- else the output text re-tokenised (a non-canonical split then shows as a divergence);
- the prompt re-tokenised, chat messages rendered through the checkpoint's chat template as
  the server did (vLLM and SGLang add no special tokens to a rendered chat prompt);
- a text-keyed top-k mapped to ids where each entry is exactly one token; a step is cut at
  its first entry that is not (a later entry would otherwise pose as the runner-up).

A trace is kept only where its ids decode back to the logged text exactly; otherwise the item
fails naming the first mismatch. `Generation.token_ids_source` says which way the ids came.
Duck-typed on the tokenizer: no torch or transformers import here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from replay_audit.diff.pieces import Piece, piece_bytes, shown
from replay_audit.engine.pieces import PieceReader
from replay_audit.formats import TokenIdsSource
from replay_audit.imports import _json as j

if TYPE_CHECKING:
    from replay_audit.imports.generation import Generation

#: A `top_k_source` that says the logged top-k was not kept, and why.
DROPPED: Final = "dropped: "
_NEEDS_TOKENIZER: Final = "needs the checkpoint's tokenizer: import with the CLI and --model DIR"
#: How to have a server log the ids.
_ASK: Final = (
    'not logged (ask the server: vLLM "return_token_ids": true, SGLang '
    '"return_prompt_token_ids": true)'
)


class Vocabulary:
    """A checkpoint's tokenizer, with the id of each piece that belongs to exactly one token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.pieces = PieceReader(tokenizer)
        owners: dict[bytes, list[int]] = {}
        for i, piece in enumerate(self.pieces(range(len(tokenizer)))):
            owners.setdefault(piece_bytes(piece), []).append(i)
        self._ids = {p: ids[0] for p, ids in owners.items() if len(ids) == 1}

    def id_of(self, piece: Piece) -> int | None:
        """The token whose piece this is; None when no token or several have it."""
        return self._ids.get(piece_bytes(piece))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(
            self.tokenizer.decode(
                list(ids),
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    def render(self, messages: Sequence[Any], field: str) -> str:
        """The chat prompt as the server renders it: the template, with the generation prompt."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise j.fail(field, "chat messages, but the checkpoint's tokenizer has no template")
        return str(
            self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
        )


def _mismatch(decoded: str, logged: str) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(decoded, logged, strict=False)) if a != b),
        min(len(decoded), len(logged)),
    )
    return (
        f"the ids decode to {decoded[at : at + 20]!r} where the log has "
        f"{logged[at : at + 20]!r} (character {at})"
    )


def _prompt(gen: Generation, vocab: Vocabulary | None) -> tuple[list[int], str | None]:
    field = gen.prompt_field or f"{gen.field}.prompt_token_ids"
    text, add = gen.prompt_text, gen.add_special_tokens
    if text is None and gen.prompt_messages is None:
        raise j.fail(field, f"{_ASK}, and no prompt text or chat messages (give the request)")
    if vocab is None:
        raise j.fail(field, f"{_ASK}; re-tokenising the prompt {_NEEDS_TOKENIZER}")
    if gen.prompt_messages is not None:
        text, add = vocab.render(gen.prompt_messages, f"{gen.field}.request.messages"), False
    assert text is not None
    body = vocab.encode(text, add_special_tokens=False)
    decoded = vocab.decode(body, skip_special_tokens=False)
    if decoded != text:
        raise j.fail(field, f"the prompt does not round-trip: {_mismatch(decoded, text)}")
    return (vocab.encode(text, add_special_tokens=True) if add else body), text


def _output(
    gen: Generation, vocab: Vocabulary | None, eos: Sequence[int]
) -> tuple[list[int], TokenIdsSource]:
    field = f"{gen.field}.token_ids"
    if vocab is None:
        raise j.fail(field, f"{_ASK}; reading them from the text {_NEEDS_TOKENIZER}")
    if gen.output_token_pieces is None:
        if gen.output_text is None:
            raise j.fail(field, "not logged, and neither are token pieces or the output text")
        return vocab.encode(gen.output_text, add_special_tokens=False), "retokenized"
    ids = []
    last = len(gen.output_token_pieces) - 1
    for t, piece in enumerate(gen.output_token_pieces):
        token = vocab.id_of(piece)
        if token is None and piece == "" and t == last and gen.stop_reason == "eos":
            # vLLM writes the eos token that ended the choice as an empty piece.
            token = gen.stop_token_id if gen.stop_token_id is not None else next(iter(eos), None)
        if token is None:
            raise j.fail(
                f"{gen.field}.{gen.steps_field}[{t}]",
                f"the logged piece {shown(piece)!r} is not exactly one token of the checkpoint's "
                "tokenizer: no ids for this output",
            )
        ids.append(token)
    return ids, "pieces"


def _text_top_k(
    gen: Generation, vocab: Vocabulary | None, output: Sequence[int]
) -> tuple[list[list[tuple[int, float]]] | None, str]:
    assert gen.text_steps is not None
    if vocab is None:
        return None, f"{DROPPED}the top-k is keyed by token text; mapping it {_NEEDS_TOKENIZER}"
    # The logged tokens' own pieces must map to their logged ids, or the server's texts are
    # not this tokenizer's pieces (an older vLLM strips SentencePiece's leading space).
    for t, (piece, logged) in enumerate(zip(gen.output_token_pieces or (), output, strict=False)):
        if vocab.id_of(piece) not in (None, logged):
            return None, (
                f"{DROPPED}the text keys are not this tokenizer's pieces: step {t}'s token "
                f"{shown(piece)!r} maps to {vocab.id_of(piece)}, logged as {logged}"
            )
    steps, cut = [], ""
    for t, step in enumerate(gen.text_steps):
        row: list[tuple[int, float]] = []
        for piece, value in sorted(step, key=lambda e: -e[1]):
            token = vocab.id_of(piece)
            if token is None or any(token == i for i, _ in row):
                cut = cut or f" (cut at step {t}: {shown(piece)!r} is not exactly one token)"
                break
            row.append((token, value))
        steps.append(row)
    if min((len(r) for r in steps), default=0) < 2:
        return None, f"{DROPPED}text keys that map to fewer than two tokens at some step{cut}"
    return steps, f"text keys mapped to ids with the checkpoint's tokenizer{cut}"


def resolve(gen: Generation, vocab: Vocabulary | None, eos: Sequence[int] = ()) -> Generation:
    """`gen` with ids for what its source logged only as text (see the module docstring).
    Raises FieldError naming the field when an id cannot be read, or when the ids do not decode
    back to the logged text."""
    changes: dict[str, Any] = {}
    sources: list[TokenIdsSource] = [gen.token_ids_source]
    if gen.prompt_token_ids is None:
        changes["prompt_token_ids"], changes["prompt_text"] = _prompt(gen, vocab)
        sources.append("retokenized")
    output = gen.output_token_ids
    if output is None:
        output, source = _output(gen, vocab, eos)
        changes["output_token_ids"] = output
        sources.append(source)
        if gen.output_text is not None:
            assert vocab is not None
            decoded = vocab.decode(output, skip_special_tokens=True)
            if decoded != gen.output_text:
                raise j.fail(
                    f"{gen.field}.token_ids",
                    f"the output does not round-trip: {_mismatch(decoded, gen.output_text)}",
                )
        if gen.output_token_pieces is None and vocab is not None:
            changes["output_token_pieces"] = vocab.pieces(output)
    if gen.text_steps is not None and gen.steps is None:
        changes["steps"], changes["top_k_source"] = _text_top_k(gen, vocab, output)
    order: tuple[TokenIdsSource, ...] = ("logged", "pieces", "retokenized")
    changes["token_ids_source"] = max(sources, key=order.index)
    return dataclasses.replace(gen, **changes)
