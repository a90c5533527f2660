"""Greedy decoding with a KV cache. A decoder runs a decode: each step's last hidden states,
float32 native logits and host-side top-k (`StepOutput`) go to a `Choose` callback, which
returns the token the arm takes there (the engine's `numerics.decide`, the same whichever
decoder ran) and whether to stop after it.

The decoders (`GenerateDecoder`, `piecewise.PiecewiseDecoder`, `CompiledDecoder`) and which
one decodes when: the `torch_engine` module docstring and docs/engine.md.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from replay_audit.engine.numerics import (
    HostTopK,
    LmHead,
    pack_top_k,
    top_k_on_host,
    top_k_size,
    unpack_top_k,
)
from replay_audit.engine.protocol import BatchLayout


@functools.cache
def cache_keyword(fn: Callable[..., Any]) -> str:
    """What transformers calls the KV cache among `fn`'s parameters: `cache` (5.2x), or
    `past_key_values` (before, and deprecated since)."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


@dataclass(frozen=True, eq=False)
class Body:
    """The transformer body as we run it: transformers' `model.model` (its final norm included),
    the row of interest among `batch_size` identical copies, on `device`."""

    model: Any
    batch_size: int
    device: torch.device

    def forward(self, ids: Sequence[int], cache: Any, start: int) -> torch.Tensor:
        """The final normed hidden states (batch, n, d) of `ids` at positions start.. (batch
        rows: identical copies). Without a cache, positions are transformers' default, as a
        plain forward of the model uses them."""
        b = self.batch_size
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device).expand(b, -1)
        pos = None
        if cache is not None:
            pos = torch.arange(start, start + len(ids), device=self.device)
            pos = pos.unsqueeze(0).expand(b, -1)
        body = self.model.model
        kv = {cache_keyword(type(body).forward): cache} if cache is not None else {}
        out = body(input_ids=x, position_ids=pos, use_cache=cache is not None, **kv)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def forward_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """A batched scan's forward of right-padded rows `ids` (rows, L), one trace each, under
        the causal mask alone (`batch`'s module docstring says why)."""
        rows, length = ids.shape
        pos = torch.arange(length, device=ids.device).unsqueeze(0).expand(rows, -1)
        out = self.model.model(input_ids=ids, position_ids=pos, use_cache=False)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden


@dataclass(frozen=True, eq=False)
class StepOutput:
    """The last position after a prefill or a step: hidden states (batch, d), float32 native
    logits of row 0 (V,), and the host-side top-k of those logits."""

    hidden: torch.Tensor
    logits: torch.Tensor
    top: HostTopK


def captured_step_output(
    hidden: torch.Tensor, z32: torch.Tensor, packed: torch.Tensor, k: int
) -> StepOutput:
    """A captured step's outputs (`pack_top_k` of `top_k_size(0)`, inside the step) as a
    `StepOutput`: one device-to-host copy, or a new top-k where more than that was asked for."""
    kk = top_k_size(0, z32.shape[-1])
    if top_k_size(k, z32.shape[-1]) != kk:
        return StepOutput(hidden, z32, top_k_on_host(z32, k))
    return StepOutput(hidden, z32, unpack_top_k(packed.cpu().numpy(), kk))


#: What a decode does with a step: the token the arm takes (row 0's, or the row of interest's)
#: and whether the decode stops after it (eos, the budget, a decode window).
Choose = Callable[[StepOutput], tuple[int, bool]]


class Decoder(Protocol):
    """A KV-cache decode from `context` (an empty cache): every step to `choose`, at most
    `max_new_tokens` of them."""

    def run(
        self,
        context: Sequence[int],
        max_new_tokens: int,
        choose: Choose,
        top_k: int,
        layout: BatchLayout | None = None,
    ) -> None: ...


def left_padded(
    rows: Sequence[Sequence[int]], pad_id: int
) -> tuple[list[list[int]], list[list[int]]]:
    """`rows` left-padded with `pad_id` to the longest, and their attention mask: a batch as
    `generate()` takes one (and as a tokenizer with `padding_side="left"` gives it)."""
    width = max(len(r) for r in rows)
    ids = [[pad_id] * (width - len(r)) + list(r) for r in rows]
    return ids, [[0] * (width - len(r)) + [1] * len(r) for r in rows]


def batch_rows(
    context: Sequence[int], batch_size: int, layout: BatchLayout | None, pad_id: int
) -> tuple[list[list[int]], list[list[int]], int]:
    """The rows `generate()` gets for a decode of `context` (prompt and any forced prefix) at
    `batch_size`: (ids, attention mask, the row of interest). Without a layout: `batch_size`
    copies of it, unpadded. With one (the logged batch): its rows, each as long as its logged
    prompt plus what `context` adds to this trace's, left-padded to the longest; the other rows
    are filler taken from `context` (their tokens change none of this row's numbers)."""
    if layout is None or layout.size != batch_size:
        return [list(context)] * batch_size, [[1] * len(context)] * batch_size, 0
    extra = len(context) - layout.prompt_lengths[layout.row]
    if extra < 0:
        raise ValueError("the context is shorter than the trace's logged prompt")
    rows = [
        list(context) if j == layout.row else (list(context) * math.ceil(m / len(context)))[:m]
        for j, m in enumerate(n + extra for n in layout.prompt_lengths)
    ]
    return *left_padded(rows, pad_id), layout.row


class GenerateDecoder:
    """A decode by transformers' own `generate()` (greedy), called as a user calls it on the
    arm's batch (`batch_rows`): the logging stack's computation itself. The engine reads each
    step through a logits processor placed after generate()'s own and forces the token
    `choose` takes (every other logit -inf); none of it changes a number the model computes.
    `own_head` False: the engine's `LmHead` gives the logits (the arm's head format is not the
    model's)."""

    def __init__(self, body: Body, head: LmHead, *, own_head: bool, pad_id: int) -> None:
        self.body = body
        self.head = head
        self.own_head = own_head
        self.pad_id = pad_id
        #: The last decode's cache (`keep_cache`): what the piecewise decoder continues from.
        self.cache: Any = None

    def run(
        self,
        context: Sequence[int],
        max_new_tokens: int,
        choose: Choose,
        top_k: int,
        layout: BatchLayout | None = None,
        *,
        keep_cache: bool = False,
    ) -> None:
        def row_choice(hidden: torch.Tensor, logits: torch.Tensor, row: int) -> tuple[int, bool]:
            z32 = logits[row]
            return choose(StepOutput(hidden[row : row + 1], z32, top_k_on_host(z32, top_k)))

        ids, mask, row = batch_rows(context, self.body.batch_size, layout, self.pad_id)
        self.run_rows(ids, mask, row, max_new_tokens, row_choice, keep_cache=keep_cache)

    def run_rows(
        self,
        ids: list[list[int]],
        mask: list[list[int]],
        row: int,
        max_new_tokens: int,
        choose: Callable[[torch.Tensor, torch.Tensor, int], tuple[int, bool]],
        *,
        keep_cache: bool = False,
    ) -> None:
        """`run_each` where `choose(hidden, logits, row)` takes one token, which every row
        gets."""

        def each(hidden: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], bool]:
            token, stop = choose(hidden, logits, row)
            return [token] * len(ids), stop

        self.run_each(ids, mask, max_new_tokens, each, keep_cache=keep_cache)

    def run_each(
        self,
        ids: list[list[int]],
        mask: list[list[int]],
        max_new_tokens: int,
        choose: Callable[[torch.Tensor, torch.Tensor], tuple[list[int], bool]],
        *,
        keep_cache: bool = False,
    ) -> None:
        """`generate()` over these rows; each step's hidden states (B, d) and float32 logits
        (B, V) handed to `choose(hidden, logits)`, which names each row's token and whether
        the decode stops after this step."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        model, dev = self.body.model, self.body.device
        x = torch.tensor(ids, dtype=torch.long, device=dev)
        last_hidden: list[torch.Tensor] = []  # the lm_head's input at this step
        stop = False

        def capture(_module: Any, args: tuple[Any, ...]) -> None:
            last_hidden[:] = [args[0]]

        def processor(_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            nonlocal stop
            hidden = last_hidden[0][:, -1]
            logits = scores if self.own_head else self.head.native(hidden).float()
            tokens, stop = choose(hidden, logits)
            forced = torch.full_like(scores, -math.inf)
            if len(set(tokens)) == 1:
                forced[:, tokens[0]] = 0.0
            else:
                rows = torch.arange(scores.shape[0], device=scores.device)
                forced[rows, torch.tensor(tokens, dtype=torch.long, device=scores.device)] = 0.0
            return forced

        def criterion(_ids: torch.Tensor, _scores: torch.Tensor, **_: Any) -> torch.Tensor:
            return torch.full((x.shape[0],), stop, device=dev)

        config: Any = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            pad_token_id=self.pad_id,
            return_dict_in_generate=keep_cache,
        )
        hook = model.get_output_embeddings().register_forward_pre_hook(capture)
        try:
            out = model.generate(
                input_ids=x,
                attention_mask=torch.tensor(mask, dtype=torch.long, device=dev),
                generation_config=config,
                logits_processor=LogitsProcessorList([processor]),
                stopping_criteria=StoppingCriteriaList([criterion]),
            )
        finally:
            hook.remove()
        self.cache = (getattr(out, "cache", None) or out.past_key_values) if keep_cache else None


class CompiledDecoder:
    """The opt-in fast decode, as gpt-fast's: a `StaticCache` reused across decodes, the step
    compiled and captured in one CUDA graph (docs/engine.md). The captured step writes its
    argmax into its token buffer and advances its position, so the host writes them only when
    an intervention changed the token or a decode starts.

    Not bitwise equal to `generate()`: its attention runs over the whole preallocated length
    with the unwritten positions masked, and fused kernels round differently.
    """

    def __init__(self, body: Body, head: LmHead, max_len: int) -> None:
        from transformers import StaticCache

        self.body = body
        self.head = head
        self.model = body.model
        b = body.batch_size
        self.cache: Any = StaticCache(config=body.model.config, max_cache_len=max_len)
        self.token = torch.zeros((b, 1), dtype=torch.long, device=body.device)
        self.position = torch.zeros((b, 1), dtype=torch.long, device=body.device)
        self.kk = top_k_size(0, head.vocab_size)
        self.graph: Any = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._capture_failed = body.device.type != "cuda"
        self.compiled = False
        self.compile_error: str | None = None
        # What the token and position buffers hold now (None: unknown, write them).
        self._dev_token: int | None = None
        self._dev_position: int | None = None
        # The decode in progress: the next position to write and the k asked for.
        self._next_position = 0
        self._top_k = 0

    def run(
        self,
        context: Sequence[int],
        max_new_tokens: int,
        choose: Choose,
        top_k: int,
        layout: BatchLayout | None = None,
    ) -> None:
        """A decode of copies of `context` (a logged `layout` decodes with `GenerateDecoder`)."""
        out = self.prefill(context, top_k)
        for n in range(1, max_new_tokens + 1):
            token, stop = choose(out)
            if stop or n == max_new_tokens:
                return
            out = self.step(token)

    def prefill(self, context: Sequence[int], top_k: int) -> StepOutput:
        self.cache.reset()
        h = self.body.forward(context, self.cache, 0)[:, -1]
        if self.graph is None and not self._capture_failed:
            self._capture()
        self._dev_token = self._dev_position = None
        self._next_position = len(context)
        self._top_k = top_k
        z32 = self.head.native(h)[0].float()
        return StepOutput(h, z32, top_k_on_host(z32, top_k))

    def step(self, token: int) -> StepOutput:
        position = self._next_position
        if token != self._dev_token:
            self.token.fill_(token)
        if position != self._dev_position:
            self.position.fill_(position)
        if self.graph is not None:
            self.graph.replay()
            assert self.outputs is not None
            h, z32, packed = self.outputs
        else:
            h, z32, packed = self._step_and_advance(self._step_body)
        out = captured_step_output(h, z32, packed, self._top_k)
        self._dev_token, self._dev_position = int(out.top.native[0]), position + 1
        self._next_position = position + 1
        return out

    def _step_body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model.model(
            input_ids=self.token,
            position_ids=self.position,
            **{cache_keyword(type(self.model.model).forward): self.cache},
            use_cache=True,
        )
        h: torch.Tensor = out.last_hidden_state[:, -1]
        z32 = self.head.native(h)[0].float()
        return h, z32, pack_top_k(z32, self.kk)

    def _step_and_advance(
        self, body: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step, then its argmax into the token buffer and the position one on."""
        h, z32, packed = body()
        self.token.copy_(packed[0, -1].to(torch.long).expand_as(self.token))
        self.position.add_(1)
        return h, z32, packed

    def _capture(self) -> None:
        """Warm up on a side stream (compiling the step first), then capture one step; the
        cache's length counters the warm-up advanced are put back.

        Captured with torch's deterministic algorithms off: under them the cache write
        (`index_copy_` at one position) takes a sort-based path that costs a third of the step.
        The write is a copy to distinct positions, exact either way, and nothing in the step
        accumulates with atomics.
        """
        lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]

        def restore() -> None:
            for layer, n in zip(self.cache.layers, lengths, strict=True):
                layer.cumulative_length.copy_(n)

        deterministic = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(False)
        try:
            stream_cls: Any = torch.cuda.Stream
            side = stream_cls()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body = self._compile(restore)
                for _ in range(2):
                    self._step_and_advance(body)
                    restore()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.outputs = self._step_and_advance(body)
            restore()
            self.graph = graph
        except RuntimeError:
            # An op that cannot be captured (a host sync): decode the static cache uncaptured.
            restore()
            self._capture_failed = True
            self.graph = None
            self.compiled = False
        finally:
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)

    def _compile(
        self, restore: Callable[[], None]
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The compiled step, run once (which compiles it), or the eager step if that fails."""
        import torch._dynamo

        # One compiled entry per compiled decoder (cache length x engine) on the same code.
        dynamo_config: Any = torch._dynamo.config
        dynamo_config.cache_size_limit = max(int(dynamo_config.cache_size_limit), 64)
        fn: Any = torch.compile(self._step_body, mode="default", dynamic=False)
        try:
            fn()
            restore()
        except Exception as exc:  # inductor and dynamo raise many kinds; keep decoding eagerly
            restore()
            self.compile_error = f"{type(exc).__name__}: {exc}"
            return self._step_body
        self.compiled = True
        step: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = fn
        return step
