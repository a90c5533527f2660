"""Log traces with transformers' own `generate()`: the reference producer of trace JSON.

Greedy, in one body dtype (the lm_head in the same dtype, as transformers runs it), with the
numerical configuration read from the running process and each step's top-k raw logits (the
model's own, before any logits processor, exactly converted to float32 by transformers).
Optionally with logits processors (`LogitsProcessors`: generate()'s `repetition_penalty`,
`no_repeat_ngram_size`, `min_new_tokens`, `sequence_bias` of one-token sequences for a logit
bias, `bad_words_ids`), which the trace records in `decoding.logits_processors`.

At a tensor-parallel degree k > 1 the checkpoint is loaded with transformers' tensor-parallel
plan on each rank of a `tensor_parallel.TpGroup`, every rank runs the same `generate()`, and
the trace records `tp_degree: k` in its configuration.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from replay_audit.diff.pieces import to_json
from replay_audit.engine.hashing import weights_sha256
from replay_audit.engine.loading import (
    apply_sdpa_policy,
    configure_numerics,
    load_model,
    load_tokenizer,
    numerical_environment,
    resolve_device,
    set_torch_threads,
)
from replay_audit.engine.numerics import top_k_on_host
from replay_audit.engine.pieces import PieceReader
from replay_audit.engine.protocol import Environment, LogitsProcessors
from replay_audit.engine.tensor_parallel import RankState, TpGroup, check_shards
from replay_audit.exceptions import EngineError
from replay_audit.json_value import JsonObject, JsonValue


def printable_text(text: str) -> str:
    """`text` with U+0000 replaced by U+FFFD: the texts are informational (the token ids are
    the record), and no database the service runs on can store a NUL in text."""
    return text.replace("\x00", "\ufffd")


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The checkpoint's eos ids: its generation config's, else its tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]


def generation_settings(processors: LogitsProcessors | None) -> dict[str, object]:
    """The `GenerationConfig` settings that make `generate()` run `processors` (a logit bias as
    `sequence_bias` of one-token sequences). `EngineError` for vLLM's `bad_words` texts, which
    generate() does not take (give `bad_words_ids`)."""
    if processors is None or not processors.active:
        return {}
    if processors.bad_words:
        raise EngineError("generate() takes bad_words_ids, not vLLM's bad_words texts")
    out: dict[str, object] = {}
    if processors.repetition_penalty not in (None, 1.0):
        out["repetition_penalty"] = float(processors.repetition_penalty or 1.0)
    if processors.no_repeat_ngram_size:
        out["no_repeat_ngram_size"] = processors.no_repeat_ngram_size
    if processors.min_new_tokens:
        out["min_new_tokens"] = processors.min_new_tokens
    if processors.logit_bias:
        out["sequence_bias"] = [[[t], float(b)] for t, b in processors.logit_bias]
    if processors.bad_words_ids:
        out["bad_words_ids"] = [list(w) for w in processors.bad_words_ids]
    return out


def processors_json(processors: LogitsProcessors | None) -> JsonObject | None:
    """`processors` as a trace's `decoding.logits_processors` (None: none ran)."""
    if processors is None or not processors.active:
        return None
    values: dict[str, JsonValue] = {
        "repetition_penalty": processors.repetition_penalty,
        "no_repeat_ngram_size": processors.no_repeat_ngram_size,
        "min_new_tokens": processors.min_new_tokens,
        "logit_bias": {str(t): b for t, b in processors.logit_bias},
        "bad_words_ids": [list(w) for w in processors.bad_words_ids],
        "bad_words": list(processors.bad_words),
    }
    return {name: values[name] for name in processors.names()}


def sorted_top_k(
    logits: torch.Tensor, k: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Per-row top-k of (T, V) float32 logits: ids and values by value descending, then id
    ascending: the engine's own top-k (`numerics.top_k_on_host`), so logged and replayed top-k
    agree, ties at the k-th place included."""
    top = top_k_on_host(logits.float(), k)
    return top.ids[:, :k], top.logits[:, :k]


class TraceGenerator:
    """A checkpoint loaded once in one dtype, producing traces prompt by prompt."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "bf16",
        attn_kernel: str | None = None,
        device: str | None = None,
        model_name: str | None = None,
        deterministic: bool = True,
        tf32: bool = False,
        threads: int | None = None,
        leave_free: int = 0,
        tp_degree: int = 1,
    ) -> None:
        """`threads`, `leave_free`: torch's CPU threads (`loading.set_torch_threads`), set here
        for the thread that builds the generator and generates. `tp_degree` > 1: a group of that
        many processes (GPUs cuda:0.., or CPU processes) is started, each loading the checkpoint
        with transformers' tensor-parallel plan; `close()` stops it."""
        self.model_dir = Path(model_dir)
        set_torch_threads(threads, leave_free=leave_free)
        self.dtype = dtype
        self.tp_degree = tp_degree
        self._group: TpGroup | None = None
        # Hashed first: a path that is no checkpoint fails before a model loads.
        self.weights_sha256 = weights_sha256(self.model_dir)
        if tp_degree > 1:
            check_shards(self.model_dir, tp_degree)
            self._group = TpGroup(tp_degree, device=device, threads=threads)
            self._key = self._group.new_key(str(self.model_dir))
            try:
                facts: _Facts = self._group.run(
                    _load_model, self._key, self.model_dir, dtype, attn_kernel, deterministic, tf32
                )
            except BaseException:
                self._group.close()
                raise
            self.tokenizer = load_tokenizer(self.model_dir)  # the ranks' own files
            #: The loaded transformers model at TP 1 (None at TP k: each rank holds its share).
            self.model = None
        else:
            configure_numerics(deterministic=deterministic, tf32=tf32)
            self.device = resolve_device(device)
            apply_sdpa_policy(self.device)  # the engine's SDPA backends: logged as replayed
            loaded = _Loaded(*load_model(self.model_dir, dtype, attn_kernel, self.device))
            self.model, self.tokenizer = loaded.model, loaded.tokenizer
            facts = _facts(loaded, self.device, dtype, 1, None)
        if self.tokenizer is None:
            self.close()
            raise EngineError(f"{self.model_dir} has no tokenizer: cannot encode prompts")
        #: What the traces record, read where the model runs (rank 0's process at TP k).
        self.config, self.vocab_size, self.eos_ids = facts.config, facts.vocab_size, facts.eos_ids
        self.pieces = PieceReader(self.tokenizer)
        self.model_name = model_name or self.model_dir.name

    def close(self) -> None:
        """Stop the tensor-parallel group, if there is one (nothing at TP 1)."""
        if self._group is not None:
            self._group.close()

    def __enter__(self) -> TraceGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """A chat prompt as servers render it: the checkpoint's chat template, with the
        generation prompt (its special tokens are in the text)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise EngineError(f"{self.model_dir}'s tokenizer has no chat template")
        return str(
            self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        ids = [int(i) for i in ids]
        if not ids:
            raise EngineError("the prompt encodes to no tokens")
        return ids

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        processors: LogitsProcessors | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """transformers' greedy `generate()`, with `processors`' generation settings: output
        ids and the per-step raw logits (T, V); at TP > 1 on every rank of the group
        (`greedy_generate`)."""
        settings = generation_settings(processors)
        if self._group is None:
            ids = self.eos_ids
            return greedy_generate(
                self.model, self.device, prompt_ids, max_new_tokens, ids, settings
            )
        seq, logits = self._group.run(
            _generate, self._key, list(prompt_ids), max_new_tokens, self.eos_ids, settings
        )
        return seq, torch.from_numpy(logits)

    def trace(
        self,
        prompt: str | Sequence[Mapping[str, str]],
        *,
        max_new_tokens: int,
        top_k: int = 5,
        external_id: str | None = None,
        tags: Sequence[str] = (),
        processors: LogitsProcessors | None = None,
    ) -> dict[str, Any]:
        """One trace as `POST /v1/traces` JSON, of a text prompt or of chat messages (rendered
        by the chat template; the trace keeps the messages and the rendered text), generated
        with `processors` (recorded in `decoding.logits_processors`). The engine imports no
        HTTP schema: callers that write or post it validate it with
        `traces.schemas.TraceCreate` at their edge."""
        messages = None if isinstance(prompt, str) else [dict(m) for m in prompt]
        text = prompt if isinstance(prompt, str) else self.render(prompt)
        prompt_ids = self.encode(text, add_special_tokens=messages is None)
        output_ids, logits = self.generate_ids(prompt_ids, max_new_tokens, processors)
        ids, vals = sorted_top_k(logits, top_k)
        stop = "eos" if output_ids and output_ids[-1] in self.eos_ids else "length"
        body = {
            "external_id": external_id,
            "model": {
                "name": self.model_name,
                "revision": None,
                "weights_sha256": self.weights_sha256,
                "vocab_size": self.vocab_size,
            },
            "config": self.config,
            "decoding": {
                "strategy": "greedy",
                "max_new_tokens": max_new_tokens,
                "eos_token_ids": self.eos_ids,
                "stop_reason": stop,
                "logits_processors": processors_json(processors),
            },
            "prompt_token_ids": prompt_ids,
            "output_token_ids": output_ids,
            "prompt_text": text,
            "prompt_messages": messages,
            "output_text": printable_text(
                self.tokenizer.decode(output_ids, skip_special_tokens=True)
            ),
            "output_token_pieces": to_json(self.pieces(output_ids)),
            "top_k": {"ids": ids.tolist(), "logits": [[float(x) for x in r] for r in vals]},
            "tags": list(tags),
        }
        return body


@torch.inference_mode()
def greedy_generate(
    model: Any,
    device: torch.device,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    settings: Mapping[str, object] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy `generate()` of `model` with `settings` (`generation_settings`
    of the logits processors): output ids and the per-step raw logits (T, V) float32."""
    from transformers import GenerationConfig

    config_cls: Any = GenerationConfig

    x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    gc = config_cls(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_ids) or None,
        pad_token_id=eos_ids[0] if eos_ids else 0,
        output_logits=True,
        return_dict_in_generate=True,
        **(settings or {}),
    )
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
    seq = [int(t) for t in out.sequences[0, x.shape[1] :].tolist()]
    logits = torch.stack([step[0] for step in out.logits]).float()
    return seq, logits


# -- operations of a tensor-parallel group (`TpGroup.run`: run on every rank) -------------------


@dataclass(frozen=True)
class _Loaded:
    """A rank's share of the checkpoint (transformers' model) and its tokenizer."""

    model: Any
    tokenizer: Any


@dataclass(frozen=True)
class _Facts:
    """What a generator's traces record of its loaded checkpoint, read where the model runs:
    the numerical configuration, the vocabulary size and the eos ids."""

    config: Environment
    vocab_size: int
    eos_ids: list[int]


def _facts(
    loaded: _Loaded,
    device: torch.device,
    dtype: str,
    tp_degree: int,
    tp_backend: str | None,
) -> _Facts:
    import transformers

    extras: dict[str, str | int | float | bool | None] = {
        "kv_cache": "dynamic",
        "producer": "replay-audit generate",
    }
    if tp_backend is not None:
        extras.update(tp_plan="auto", tp_backend=tp_backend)
    config = numerical_environment(
        dtype=dtype,
        lm_head_dtype=dtype,
        weight_dtype=dtype,
        device=device,
        attn_kernel=str(loaded.model.config._attn_implementation),
        batch_size=1,
        engine_name="transformers",
        engine_version=transformers.__version__,
        tp_degree=tp_degree,
        extras=extras,
    )
    model = loaded.model
    return _Facts(config, int(model.config.vocab_size), eos_token_ids(model, loaded.tokenizer))


def _load_model(
    state: RankState,
    key: str,
    model_dir: Path,
    dtype: str,
    attn_kernel: str | None,
    deterministic: bool,
    tf32: bool,
) -> _Facts:
    """This rank's share of the checkpoint, with the generator's numerical flags; what the
    traces record of it."""
    configure_numerics(deterministic=deterministic, tf32=tf32)
    place = state.placement
    apply_sdpa_policy(place.device)
    loaded = _Loaded(*load_model(model_dir, dtype, attn_kernel, place.device, tp=place))
    state.objects[key] = loaded
    return _facts(loaded, place.device, dtype, place.degree, place.backend)


def _generate(
    state: RankState,
    key: str,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    settings: Mapping[str, object],
) -> tuple[list[int], npt.NDArray[np.float32]]:
    """`greedy_generate` on this rank; the logits on the host (what every rank compares)."""
    model = state.get(key, _Loaded).model
    seq, logits = greedy_generate(
        model, state.placement.device, prompt_ids, max_new_tokens, eos_ids, settings
    )
    return seq, np.asarray(logits.cpu().numpy(), dtype=np.float32)


def generate_traces(
    model_dir: str | Path,
    prompts: Iterable[tuple[str | None, str]],
    *,
    dtype: str = "bf16",
    max_new_tokens: int = 64,
    top_k: int = 5,
    attn_kernel: str | None = None,
    device: str | None = None,
    tags: Sequence[str] = (),
    model_name: str | None = None,
    threads: int | None = None,
    leave_free: int = 0,
    tp_degree: int = 1,
) -> Iterator[dict[str, Any]]:
    """Traces of greedy generations, one per (prompt id, prompt text), as `TraceCreate` JSON
    (at `tp_degree` > 1, by a group of that many processes, stopped when the traces end)."""
    with TraceGenerator(
        model_dir,
        dtype=dtype,
        attn_kernel=attn_kernel,
        device=device,
        model_name=model_name,
        threads=threads,
        leave_free=leave_free,
        tp_degree=tp_degree,
    ) as gen:
        for pid, text in prompts:
            yield gen.trace(
                text, max_new_tokens=max_new_tokens, top_k=top_k, external_id=pid, tags=tags
            )
