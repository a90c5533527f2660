"""Token ids of logs that carry text, read with the checkpoint's tokenizer.

Many logs carry no ids: vLLM before `return_token_ids` (0.10.2) or requests without it, other
OpenAI-compatible servers, the OpenAI API, SGLang's prompt under its default
`logprob_start_len=-1`. And a top-k is often keyed by token text (vLLM without
`return_tokens_as_token_ids`, OpenAI). `generation.resolve` fills what is missing, with this
module's `Vocabulary`, in this order of trust:

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

from collections.abc import Sequence
from typing import Any, Final

from replay_audit.diff.pieces import Piece, piece_bytes
from replay_audit.engine.pieces import PieceReader
from replay_audit.imports import _json as j

#: A `top_k_source` that says the logged top-k was not kept, and why.
DROPPED: Final = "dropped: "


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
