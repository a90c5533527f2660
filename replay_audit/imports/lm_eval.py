"""lm-evaluation-harness `--log_samples` files: `samples_<task>_<date>.jsonl` (+ the run's
`results_<date>.json`). Pure, given a tokenizer.

Field names, checked against the source (EleutherAI/lm-evaluation-harness):
- `lm_eval/evaluator.py` (the `example` dict of `evaluate`): `doc_id`, `doc`, `target`,
  `arguments`, `resps`, `filtered_resps`, `filter`, `metrics`, `doc_hash`, `prompt_hash`,
  `target_hash`; `results["config"]` = `model`, `model_args`, `model_dtype` (HFLM's
  `get_model_info`), `batch_size`, `device`, `gen_kwargs`, seeds; `results["date"]`.
- `lm_eval/loggers/evaluation_tracker.py` (`save_results_samples`): the file name, and
  `arguments` rewritten as `{"gen_args_<i>": {"arg_<j>": ...}}`, `target` as a string.
- `lm_eval/loggers/utils.py`: `transformers_version`, `pretty_env_info`, `max_length`,
  `tokenizer_bos_token`, ... in the results JSON; `chat_template` there when the run applied
  one (the context strings of the samples are then already templated).
- `lm_eval/models/huggingface.py`: `generate_until` encodes each context with
  `tok_batch_encode` (no special tokens added when the context starts with the BOS string,
  else the tokenizer's default or `add_bos_token`), left-truncated to `max_length -
  max_gen_toks`, and decodes the continuation, cut at the `until` strings.
- `lm_eval/models/vllm_causallms.py` (`model: vllm`): contexts encoded with
  `add_special_tokens=add_bos_token` (False unless given, True for gemma), the rest of
  gen_kwargs as `SamplingParams` (temperature 0.0 unless given, `do_sample` dropped).

The samples carry text, not token ids: the import re-tokenises both the context and the
response with the checkpoint's own tokenizer, and every trace says so
(`config.extras["tokenization"]`). A re-tokenised response need not be the token sequence
the model generated (a stop string cut mid-token, a non-canonical tokenization): a replay may
then diverge for reasons that are not numerical, and the import cannot tell. Loglikelihood
samples (multiple choice) are scores, not generations, and give no trace. A task with several
filters (gsm8k: `strict-match`, `flexible-extract`, `lm_eval/tasks/gsm8k/gsm8k.yaml`) writes a
line per doc and filter with the same `resps`: `merge_filters` makes them one generation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

from replay_audit.engine.pieces import PieceReader
from replay_audit.formats import LOGGED_DEVICES, Strategy, body_dtype
from replay_audit.imports import _json as j
from replay_audit.imports.generation import Generation
from replay_audit.imports.openai_compat import RECIPE_FIELDS, decoding_recipe, extra_value
from replay_audit.imports.processors import read_processors
from replay_audit.imports.schemas import EXTRA_REQUEST_BATCH
from replay_audit.json_value import JsonObject

#: `config.extras["tokenization"]` of every lm-eval trace.
TOKENIZATION: Final = "re-tokenised from lm-eval text with the checkpoint tokenizer"
#: The run's seeds (the results JSON's `config`), kept in `config.extras` under their names.
SEEDS: Final = ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")
#: A request's `gen_kwargs` kept in `config.extras` under their names: the stop strings and
#: the sampling fields (what a replay uses is also read into `decoding`).
GEN_KWARGS_KEPT: Final = ("until", "do_sample", *RECIPE_FIELDS)


class Tokenizer(Protocol):
    """What the import needs of a transformers tokenizer."""

    bos_token: str | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class NotAGeneration(Exception):
    """A sample that is not a generation (a loglikelihood request): skipped, not an error."""


def _model_args(value: Any) -> dict[str, str]:
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, str):
        pairs = (part.partition("=") for part in value.split(","))
        return {key.strip(): val.strip() for key, sep, val in pairs if sep}
    return {}


def context_from_results(results: Mapping[str, Any]) -> JsonObject:
    """What an lm-eval results JSON states of the run (the dtype as loaded, the batch size and
    device asked for, the transformers version), as `ImportContext` keys."""
    config = results.get("config")
    config = config if isinstance(config, Mapping) else {}
    out: JsonObject = {}
    dtype = body_dtype(config.get("model_dtype", ""))
    if dtype is None:
        dtype = body_dtype(_model_args(config.get("model_args")).get("dtype", ""))
    if dtype is not None:
        out["dtype"] = dtype
    batch = _count(config.get("batch_size"))
    # lm-eval hands vLLM `batch_size` requests per generate() call, which it batches
    # dynamically: only a batch of 1 is the batch that ran (`EXTRA_REQUEST_BATCH` has others).
    if batch is not None and (config.get("model") != "vllm" or batch == 1):
        out["batch_size"] = batch
    device = config.get("device")
    if isinstance(device, str) and device:
        kind = device.split(":")[0]
        if kind in LOGGED_DEVICES:
            out["device"] = kind
    version = results.get("transformers_version")
    if config.get("model") == "hf":  # lm-eval's HFLM: transformers' generate()
        engine: JsonObject = {"name": "transformers"}
        if isinstance(version, str) and version and version != "N/A":
            engine["version"] = version
        out["engine"] = engine
    elif config.get("model") == "vllm":  # lm_eval/models/vllm_causallms.py
        out["engine"] = {"name": "vllm"}
        tp = _count(_model_args(config.get("model_args")).get("tensor_parallel_size"))
        if tp is not None:
            out["tp_degree"] = tp
    return out


def _count(value: Any) -> int | None:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return value if ok else None


def _add_bos(config: Mapping[str, Any]) -> bool | None:
    """`add_bos_token` of `model_args`, else the backend's default: lm-eval's vLLM encodes
    without special tokens (`add_bos_token=False`) but for a model named gemma; None: the
    tokenizer's default (HF)."""
    args = _model_args(config.get("model_args"))
    given = args.get("add_bos_token")
    if given is not None:
        return given.lower() == "true"
    if config.get("model") == "vllm":
        return "gemma" in args.get("pretrained", "").lower()
    return None


def _arguments(sample: Mapping[str, Any], path: str) -> list[tuple[Any, Any]]:
    args = sample.get("arguments")
    if isinstance(args, Mapping):  # as saved: {"gen_args_0": {"arg_0": ctx, "arg_1": kwargs}}
        where = f"{path}.arguments.gen_args_"
        entries = [j.obj(args.get(f"gen_args_{i}"), f"{where}{i}") for i in range(len(args))]
        return [(e.get("arg_0"), e.get("arg_1")) for e in entries]
    if isinstance(args, list):  # in memory: [[ctx, kwargs], ...]
        pairs = [j.seq(a, f"{path}.arguments[{i}]") for i, a in enumerate(args)]
        return [(p[0] if p else None, p[1] if len(p) > 1 else None) for p in pairs]
    raise j.fail(f"{path}.arguments", "missing (is this a --log_samples file?)")


def _encode(tokenizer: Tokenizer, text: str, add_bos: bool | None) -> list[int]:
    # As lm-eval's tok_batch_encode (the module docstring).
    bos = tokenizer.bos_token
    if bos and text.startswith(bos):
        return list(tokenizer.encode(text, add_special_tokens=False))
    if add_bos is not None:
        return list(tokenizer.encode(text, add_special_tokens=add_bos))
    return list(tokenizer.encode(text))


def _continuation_ids(
    tokenizer: Tokenizer,
    context_ids: Sequence[int],
    context: str,
    response: str,
    add_bos: bool | None,
) -> list[int]:
    # Tokenised with its context where the context's ids are a prefix of the whole (how a
    # SentencePiece tokenizer spaces the first token), else on its own.
    whole = _encode(tokenizer, context + response, add_bos)
    if whole[: len(context_ids)] == list(context_ids):
        return whole[len(context_ids) :]
    return list(tokenizer.encode(response, add_special_tokens=False))


def parse_lm_eval_sample(
    sample: Any,
    *,
    task: str,
    tokenizer: Tokenizer,
    results: Mapping[str, Any] | None = None,
    path: str = "sample",
    skipped: list[str] | None = None,
) -> list[Generation]:
    """The generations of one `--log_samples` line (one per request and repeat). An empty
    response (the model's first token was an `until` string or eos, cut away by lm-eval)
    gives no trace: its field is appended to `skipped`. Raises NotAGeneration for a
    loglikelihood sample, FieldError naming the field otherwise."""
    body = j.obj(sample, path)
    doc_id = body.get("doc_id")
    requests = _arguments(body, path)
    resps = j.seq(body.get("resps"), f"{path}.resps")
    if len(resps) != len(requests):
        raise j.fail(f"{path}.resps", f"{len(resps)} responses for {len(requests)} requests")
    results = results or {}
    config = results.get("config") if isinstance(results.get("config"), Mapping) else {}
    assert isinstance(config, Mapping)
    add_bos = _add_bos(config)
    vllm = config.get("model") == "vllm"
    # The requests handed to vLLM per call (`context_from_results`): not a batch that ran.
    handed = config.get("batch_size") if vllm and _count(config.get("batch_size")) != 1 else None
    max_length = results.get("max_length")
    target = body.get("target")
    date = results.get("date")
    run = f":{date}" if isinstance(date, int | float | str) and date != "" else ""
    # The tokenizer is at hand: each output token's piece, where it is a transformers one.
    pieces = PieceReader(tokenizer) if hasattr(tokenizer, "convert_ids_to_tokens") else None
    names = body.get("filters")
    extras = {
        "tokenization": TOKENIZATION,
        "chat_template": "applied by lm-eval" if results.get("chat_template") else "none",
        # The task's filters: answer extractors of this one generation.
        **({"filters": ",".join(map(str, names))} if isinstance(names, list) else {}),
        **{k: extra_value(config[k]) for k in SEEDS if config.get(k) is not None},
        **({EXTRA_REQUEST_BATCH: extra_value(handed)} if handed is not None else {}),
    }
    out = []
    for i, (context, kwargs) in enumerate(requests):
        if not isinstance(kwargs, Mapping):
            raise NotAGeneration(
                f"{path}: a loglikelihood sample (scores, not a generation): no trace"
            )
        if not isinstance(context, str):
            raise j.fail(f"{path}.arguments.gen_args_{i}.arg_0", "expected the context text")
        max_gen = kwargs.get("max_gen_toks")
        max_gen = max_gen if isinstance(max_gen, int) and max_gen >= 1 else None
        # HF decodes greedily with do_sample false whatever the temperature (lm-eval's HFLM
        # sets it false itself for temperature 0).
        do_sample = kwargs.get("do_sample")
        greedy = do_sample is False or (
            not do_sample and kwargs.get("temperature", 0.0) in (0, 0.0, None)
        )
        # The rest of gen_kwargs go to generate(): its logits processors ran too.
        processors = read_processors(kwargs, clamp_logit_bias=False)
        strategy: Strategy | None = (
            ("other" if processors.not_replayed else "greedy") if greedy else "sample"
        )
        if vllm:  # SamplingParams(**gen_kwargs), temperature 0.0 unless given; no do_sample
            params = {**kwargs, "temperature": kwargs.get("temperature", 0.0)}
            strategy, processors = decoding_recipe(params, clamp_logit_bias=False)
        recipe = {k: extra_value(kwargs[k]) for k in GEN_KWARGS_KEPT if kwargs.get(k) is not None}
        prompt = _encode(tokenizer, context, add_bos)
        if isinstance(max_length, int) and max_gen is not None and max_length > max_gen:
            prompt = prompt[-(max_length - max_gen) :]
        repeats = j.seq(resps[i], f"{path}.resps[{i}]")
        for r, response in enumerate(repeats):
            if not isinstance(response, str):
                raise j.fail(f"{path}.resps[{i}][{r}]", "expected the generated text")
            output = _continuation_ids(tokenizer, prompt, context, response, add_bos)
            if not output:
                if skipped is not None:
                    skipped.append(f"{path}.resps[{i}][{r}]")
                continue
            suffix = "" if len(requests) == 1 and len(repeats) == 1 else f":{i}:{r}"
            out.append(
                Generation(
                    field=f"{path}.resps[{i}][{r}]",
                    prompt_token_ids=prompt,
                    output_token_ids=output,
                    # Why it stopped (eos, an `until` string, max_gen_toks) is not logged.
                    stop_reason="other",
                    prompt_text=context,
                    output_text=response,
                    external_id=f"lm-eval:{task}:{doc_id}{suffix}{run}",
                    strategy=strategy or "other",
                    processors=processors,
                    token_ids_source="retokenized",
                    max_new_tokens=max_gen,
                    reference_answer=None if target is None else str(target),
                    tags=("lm-eval", f"task={task}"),
                    extras={**extras, **recipe},
                    output_token_pieces=pieces(output) if pieces is not None else None,
                )
            )
    return out


def merge_filters(samples: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """One sample per doc and generation (see the module docstring), the filters' names kept in
    order as `filters`. Anything that is not a sample passes as it is."""
    out: list[tuple[str, Any]] = []
    first: dict[tuple[str, str], int] = {}
    for where, sample in samples:
        if not isinstance(sample, Mapping) or "filter" not in sample:
            out.append((where, sample))
            continue
        key = (json.dumps(sample.get("doc_id")), json.dumps(sample.get("resps")))
        if key in first:
            out[first[key]][1]["filters"].append(sample["filter"])
            continue
        first[key] = len(out)
        out.append((where, {**sample, "filters": [sample["filter"]]}))
    return out


def task_from_filename(name: str) -> str | None:
    """`samples_<task>_<date>.jsonl` -> task (the date is the last `_` part)."""
    if not name.startswith("samples_") or not name.endswith(".jsonl"):
        return None
    task, sep, _ = name[len("samples_") : -len(".jsonl")].rpartition("_")
    return task if sep and task else None
