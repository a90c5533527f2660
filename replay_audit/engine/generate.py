"""Log traces with transformers' own `generate()`: the reference producer of trace JSON.

Greedy, in one body dtype (the lm_head in the same dtype, as transformers runs it), exactly as
a user's plain `model.generate(input_ids, attention_mask=..., do_sample=False)` runs: nothing
process-wide is set (no attention backend, no deterministic or TF32 switch the caller did not
ask for), prompts batched as a user batches them (left-padded to the longest, with the
attention mask), each trace recording its batch layout (`decoding.batch`), the numerical
configuration read from the running process, the SDPA backends torch picked for the call
(`extras.attention_backends`) and each step's top-k raw logits (the model's own, before any
logits processor, exactly converted to float32 by transformers). At TP k > 1 every rank of a
`tensor_parallel.TpGroup` runs the same `generate()`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from replay_audit.diff.pieces import to_json
from replay_audit.engine import attention
from replay_audit.engine.decoder import left_padded
from replay_audit.engine.hashing import weights_sha256
from replay_audit.engine.loading import (
    ProcessNumerics,
    load_model,
    load_tokenizer,
    numerical_environment,
    resolve_device,
    set_torch_threads,
)
from replay_audit.engine.numerics import top_k_on_host
from replay_audit.engine.pieces import PieceReader
from replay_audit.engine.protocol import Environment, LogitsProcessors, SamplingRecipe
from replay_audit.engine.tensor_parallel import RankState, TpGroup, check_shards
from replay_audit.exceptions import EngineError
from replay_audit.formats import NoiseDevice, SamplingJson
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


def sampling_settings(recipe: SamplingRecipe | None) -> dict[str, object]:
    """The `GenerationConfig` settings of a transformers sampling recipe: `do_sample` and its
    three warpers, every other warper off (the library's defaults would add top_k 50)."""
    if recipe is None:
        return {}
    if recipe.sampler != "transformers":
        raise EngineError(f"generate() samples as transformers does, not as {recipe.sampler}")
    return {
        "do_sample": True,
        "temperature": recipe.temperature,
        "top_k": recipe.top_k,
        "top_p": recipe.top_p,
        "min_p": None,
        "typical_p": 1.0,
        "epsilon_cutoff": 0.0,
        "eta_cutoff": 0.0,
    }


def sampling_json(recipe: SamplingRecipe, seed: int, device: torch.device) -> SamplingJson:
    """A sampled trace's `decoding.sampling`: the recipe, the seed, the generator's device
    (a verification draws the noise of CPU and CUDA generators only)."""
    kind: NoiseDevice = "cuda" if device.type == "cuda" else "cpu"
    if device.type != kind:
        raise EngineError(f"sampled on {device.type}: only CPU and CUDA noise is reproduced")
    return {**recipe.to_json(), "seed": seed, "device": kind}


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


#: A trace as `POST /v1/traces` JSON (the engine imports no HTTP schema: the callers that write
#: or post it validate it with `traces.schemas.TraceCreate` at their edge).
TraceJson: TypeAlias = dict[str, Any]


class TraceGenerator:
    """A checkpoint loaded once in one dtype, producing traces a batch of prompts at a time."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "bf16",
        attn_kernel: str | None = None,
        device: str | None = None,
        model_name: str | None = None,
        deterministic: bool | None = None,
        tf32: bool | None = None,
        threads: int | None = None,
        leave_free: int = 0,
        tp_degree: int = 1,
    ) -> None:
        """`deterministic`, `tf32`: torch's switches during the generations (None: as this
        process has them, as plain `generate()` runs). `threads`, `leave_free`:
        `loading.set_torch_threads`. `tp_degree` > 1 starts a group; `close()` stops it."""
        self.model_dir = Path(model_dir)
        set_torch_threads(threads, leave_free=leave_free)
        self.dtype = dtype
        self.tp_degree = tp_degree
        self.numerics = ProcessNumerics(deterministic, tf32)
        self._group: TpGroup | None = None
        # Hashed first: a path that is no checkpoint fails before a model loads.
        self.weights_sha256 = weights_sha256(self.model_dir)
        if tp_degree > 1:
            check_shards(self.model_dir, tp_degree)
            self._group = TpGroup(tp_degree, device=device, threads=threads)
            self._key = self._group.new_key(str(self.model_dir))
            try:
                facts: _Facts = self._group.run(
                    _load_model, self._key, self.model_dir, dtype, attn_kernel, self.numerics
                )
            except BaseException:
                self._group.close()
                raise
            self.tokenizer = load_tokenizer(self.model_dir)  # the ranks' own files
            #: The loaded transformers model at TP 1 (None at TP k: each rank holds its share).
            self.model = None
        else:
            self.device = resolve_device(device)
            self.model, self.tokenizer = load_model(self.model_dir, dtype, attn_kernel, self.device)
            facts = _facts(self.model, self.tokenizer, self.device, dtype, 1, None, self.numerics)
        if self.tokenizer is None:
            self.close()
            raise EngineError(f"{self.model_dir} has no tokenizer: cannot encode prompts")
        #: What the traces record, read where the model runs (rank 0's process at TP k).
        self.config, self.vocab_size, self.eos_ids = facts.config, facts.vocab_size, facts.eos_ids
        self.pad_id = facts.pad_id
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

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        processors: LogitsProcessors | None = None,
        *,
        sampling: SamplingRecipe | None = None,
        seed: int = 0,
    ) -> Generated:
        """`greedy_generate` of these prompts in one batch; at TP > 1 on every rank. With
        `sampling`, `generate(do_sample=True)` after `torch.manual_seed(seed)`, as a user
        seeds it."""
        settings = {**generation_settings(processors), **sampling_settings(sampling)}
        rows = [list(p) for p in prompts]
        seeded = seed if sampling is not None else None
        if self._group is None:
            with self.numerics.applied():
                return greedy_generate(
                    self.model,
                    self.device,
                    rows,
                    max_new_tokens,
                    self.eos_ids,
                    settings,
                    pad_id=self.pad_id,
                    seed=seeded,
                )
        outputs, backends = self._group.run(
            _generate, self._key, rows, max_new_tokens, self.eos_ids, settings, self.pad_id, seeded
        )
        return Generated([(ids, torch.from_numpy(z)) for ids, z in outputs], backends)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        processors: LogitsProcessors | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """`generate_batch` of one prompt: its output ids and per-step raw logits (T, V)."""
        return self.generate_batch([prompt_ids], max_new_tokens, processors).rows[0]

    def trace(
        self,
        prompt: str | Sequence[Mapping[str, str]],
        *,
        max_new_tokens: int,
        top_k: int = 5,
        external_id: str | None = None,
        tags: Sequence[str] = (),
        processors: LogitsProcessors | None = None,
    ) -> TraceJson:
        """`trace_batch` of one prompt (a batch of one)."""
        return self.trace_batch(
            [(external_id, prompt)],
            max_new_tokens=max_new_tokens,
            top_k=top_k,
            tags=tags,
            processors=processors,
        )[0]

    def trace_batch(
        self,
        prompts: Sequence[tuple[str | None, str | Sequence[Mapping[str, str]]]],
        *,
        max_new_tokens: int,
        top_k: int = 5,
        tags: Sequence[str] = (),
        processors: LogitsProcessors | None = None,
        sampling: SamplingRecipe | None = None,
        seed: int = 0,
    ) -> list[TraceJson]:
        """The traces of (external id, prompt) pairs generated in one `generate()` call, as
        `TraceJson`. A chat prompt is rendered by the chat template; the trace keeps the
        messages and the rendered text. With `sampling`, seeded sampling (`generate_batch`):
        each trace records its recipe, the seed and its row of the batch."""
        texts, messages, ids = [], [], []
        for _, prompt in prompts:
            chat = None if isinstance(prompt, str) else [dict(m) for m in prompt]
            text = prompt if isinstance(prompt, str) else self.render(prompt)
            texts.append(text)
            messages.append(chat)
            ids.append(self.encode(text, add_special_tokens=chat is None))
        generated = self.generate_batch(
            ids, max_new_tokens, processors, sampling=sampling, seed=seed
        )
        noise_device = self.device if self._group is None else torch.device(self.config["device"])
        sampled: dict[str, object] = (
            {} if sampling is None else {"sampling": sampling_json(sampling, seed, noise_device)}
        )
        extras = dict(self.config["extras"])
        if generated.backends is not None:
            extras["attention_backends"] = generated.backends
        config = {**self.config, "batch_size": len(prompts), "extras": extras}
        lengths = [len(p) for p in ids]
        out = []
        for row, ((external_id, _), (output_ids, logits)) in enumerate(
            zip(prompts, generated.rows, strict=True)
        ):
            top_ids, top_vals = sorted_top_k(logits, top_k)
            stop = "eos" if output_ids and output_ids[-1] in self.eos_ids else "length"
            out.append(
                {
                    "external_id": external_id,
                    "model": {
                        "name": self.model_name,
                        "revision": None,
                        "weights_sha256": self.weights_sha256,
                        "vocab_size": self.vocab_size,
                    },
                    "config": config,
                    "decoding": {
                        "strategy": "greedy" if sampling is None else "sample",
                        **sampled,
                        "max_new_tokens": max_new_tokens,
                        "eos_token_ids": self.eos_ids,
                        "stop_reason": stop,
                        "logits_processors": processors_json(processors),
                        **(
                            {"batch": {"prompt_lengths": lengths, "row": row}}
                            if len(ids) > 1
                            else {}
                        ),
                    },
                    "prompt_token_ids": ids[row],
                    "output_token_ids": output_ids,
                    "prompt_text": texts[row],
                    "prompt_messages": messages[row],
                    "output_text": printable_text(
                        self.tokenizer.decode(output_ids, skip_special_tokens=True)
                    ),
                    "output_token_pieces": to_json(self.pieces(output_ids)),
                    "top_k": {
                        "ids": top_ids.tolist(),
                        "logits": [[float(x) for x in r] for r in top_vals],
                    },
                    "tags": list(tags),
                }
            )
        return out


@dataclass(frozen=True)
class Generated:
    """One `generate()` call: each row's output ids (to its first eos) and per-step raw
    logits (T, V) float32, and the SDPA backends the call ran (None: no SDPA call)."""

    rows: list[tuple[list[int], torch.Tensor]]
    backends: str | None


@torch.inference_mode()
def greedy_generate(
    model: Any,
    device: torch.device,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    settings: Mapping[str, object] | None = None,
    *,
    pad_id: int = 0,
    seed: int | None = None,
) -> Generated:
    """transformers' greedy `generate()` of `prompts` as one batch, left-padded as a user's,
    with `settings` (`generation_settings`; `sampling_settings`: sampled, after
    `torch.manual_seed(seed)`)."""
    from transformers import GenerationConfig

    config_cls: Any = GenerationConfig
    ids, padding = left_padded(prompts, pad_id)
    x = torch.tensor(ids, dtype=torch.long, device=device)
    mask = torch.tensor(padding, dtype=torch.long, device=device)
    gc = config_cls(
        **{
            "do_sample": False,
            "num_beams": 1,
            "max_new_tokens": max_new_tokens,
            "eos_token_id": list(eos_ids) or None,
            "pad_token_id": pad_id,
            "output_logits": True,
            "return_dict_in_generate": True,
            **(settings or {}),
        }
    )
    if seed is not None:
        torch.manual_seed(seed)
    with attention.observe() as seen:
        out = model.generate(input_ids=x, attention_mask=mask, generation_config=gc)
    logits = torch.stack(list(out.logits), dim=1).float()  # (B, T, V)
    eos = set(eos_ids)
    rows = []
    for b in range(len(prompts)):
        new = [int(t) for t in out.sequences[b, x.shape[1] :].tolist()]
        end = next((t + 1 for t, token in enumerate(new) if token in eos), len(new))
        rows.append((new[:end], logits[b, :end]))
    return Generated(rows, seen.backends())


# -- operations of a tensor-parallel group (`TpGroup.run`: run on every rank) -------------------


class _RankGenerator(NamedTuple):
    """A rank's share of the checkpoint and the switches its generations run under."""

    model: Any
    numerics: ProcessNumerics


@dataclass(frozen=True)
class _Facts:
    """What a generator's traces record of its checkpoint, read where the model runs."""

    config: Environment
    vocab_size: int
    eos_ids: list[int]
    pad_id: int


def _facts(
    model: Any,
    tokenizer: Any,
    device: torch.device,
    dtype: str,
    tp_degree: int,
    tp_backend: str | None,
    numerics: ProcessNumerics,
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
        attn_kernel=str(model.config._attn_implementation),
        batch_size=1,
        engine_name="transformers",
        engine_version=transformers.__version__,
        tp_degree=tp_degree,
        numerics=numerics,
        extras=extras,
    )
    eos = eos_token_ids(model, tokenizer)
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    pad_id = int(pad) if isinstance(pad, int) else (eos[0] if eos else 0)
    return _Facts(config, int(model.config.vocab_size), eos, pad_id)


def _load_model(
    state: RankState,
    key: str,
    model_dir: Path,
    dtype: str,
    attn_kernel: str | None,
    numerics: ProcessNumerics,
) -> _Facts:
    """This rank's share of the checkpoint; what the traces record of it."""
    place = state.placement
    model, tokenizer = load_model(model_dir, dtype, attn_kernel, place.device, tp=place)
    state.objects[key] = _RankGenerator(model, numerics)
    return _facts(model, tokenizer, place.device, dtype, place.degree, place.backend, numerics)


def _generate(
    state: RankState,
    key: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: list[int],
    settings: Mapping[str, object],
    pad_id: int,
    seed: int | None = None,
) -> tuple[list[tuple[list[int], npt.NDArray[np.float32]]], str | None]:
    """`greedy_generate` on this rank; the logits on the host (what every rank compares)."""
    model, numerics = state.get(key, _RankGenerator)
    with numerics.applied():
        g = greedy_generate(
            model,
            state.placement.device,
            prompts,
            max_new_tokens,
            eos_ids,
            settings,
            pad_id=pad_id,
            seed=seed,
        )
    rows = [(ids, np.asarray(z.cpu().numpy(), dtype=np.float32)) for ids, z in g.rows]
    return rows, g.backends


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
) -> Iterator[TraceJson]:
    """Traces of greedy generations, one `generate()` call per (prompt id, prompt text)."""
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
