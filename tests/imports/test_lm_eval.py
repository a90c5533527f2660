"""lm-evaluation-harness `--log_samples` files -> traces, re-tokenised with the bundled
checkpoint's tokenizer.

The sample and results fixtures below follow the harness's own source
(EleutherAI/lm-evaluation-harness): lm_eval/evaluator.py (the `example` dict: doc_id, doc,
target, arguments, resps, filtered_resps, filter, metrics, doc_hash, prompt_hash, target_hash;
results["config"] with model, model_args, model_dtype, batch_size, device; results["date"]),
lm_eval/loggers/evaluation_tracker.py (`arguments` saved as {"gen_args_i": {"arg_j": ...}},
`target` as a string, file names samples_<task>_<date>.jsonl and results_<date>.json),
lm_eval/loggers/utils.py (transformers_version, max_length, tokenizer_* in the results) and
lm_eval/models/huggingface.py (how generate_until encodes a context).
"""

from __future__ import annotations

from typing import Any

import pytest

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine.hashing import weights_sha256
from replay_audit.engine.loading import load_tokenizer
from replay_audit.exceptions import FieldError
from replay_audit.imports.generation import build_trace
from replay_audit.imports.lm_eval import (
    TOKENIZATION,
    NotAGeneration,
    context_from_results,
    parse_lm_eval_sample,
    task_from_filename,
)
from replay_audit.imports.schemas import ImportContext

TOKENIZER = load_tokenizer(BUNDLED_MODEL_DIR)

RESULTS: dict[str, Any] = {
    "results": {"arith": {"alias": "arith", "exact_match,none": 0.5}},
    "config": {
        "model": "hf",
        "model_args": f"pretrained={BUNDLED_MODEL_DIR},dtype=float32",
        "model_num_parameters": 1_500_000,
        "model_dtype": "torch.float32",
        "model_revision": "main",
        "model_sha": "",
        "batch_size": 1,
        "batch_sizes": [],
        "device": "cpu",
        "use_cache": None,
        "limit": None,
        "bootstrap_iters": 100000,
        "gen_kwargs": None,
        "random_seed": 0,
        "numpy_seed": 1234,
        "torch_seed": 1234,
        "fewshot_seed": 1234,
    },
    "git_hash": None,
    "date": 1733000000.5,
    "transformers_version": "5.23.0",
    "lm_eval_version": "0.4.13",
    "max_length": 512,
    "chat_template": None,
}


def sample(doc_id: int = 3, response: str = " 4\n", **edits: Any) -> dict[str, Any]:
    context = "Question: 2 + 2 =\nAnswer:"
    body: dict[str, Any] = {
        "doc_id": doc_id,
        "doc": {"question": "2 + 2 =", "answer": "4"},
        "target": "4",
        "arguments": {
            "gen_args_0": {
                "arg_0": context,
                "arg_1": {
                    "until": ["\n"],
                    "do_sample": False,
                    "temperature": 0.0,
                    "max_gen_toks": 16,
                },
            }
        },
        "resps": [[response]],
        "filtered_resps": [response.strip()],
        "filter": "none",
        "metrics": ["exact_match"],
        "doc_hash": "a" * 64,
        "prompt_hash": "b" * 64,
        "target_hash": "c" * 64,
        "exact_match": 1.0,
    }
    body.update(edits)
    return body


def context(results: dict[str, Any] = RESULTS) -> ImportContext:
    values = {
        **context_from_results(results),
        "model": {
            "name": "tiny-llama",
            "weights_sha256": weights_sha256(BUNDLED_MODEL_DIR),
            "vocab_size": 4096,
        },
    }
    return ImportContext.model_validate(values)


def test_a_generate_until_sample_becomes_a_re_tokenised_trace() -> None:
    [gen] = parse_lm_eval_sample(sample(), task="arith", tokenizer=TOKENIZER, results=RESULTS)
    trace = build_trace(gen, context(), "lm-eval")
    prompt_ids = TOKENIZER("Question: 2 + 2 =\nAnswer:")["input_ids"]
    assert trace.prompt_token_ids == prompt_ids
    assert TOKENIZER.decode(trace.output_token_ids) == " 4\n"
    # The checkpoint's tokenizer gives each output token's piece: they spell the response.
    assert trace.output_token_pieces is not None
    assert "".join(str(p) for p in trace.output_token_pieces) == " 4\n"
    assert trace.reference_answer == "4"  # the task's target
    assert trace.external_id == "lm-eval:arith:3:1733000000.5"
    assert trace.tags == ["lm-eval", "task=arith"]
    assert trace.decoding.strategy == "greedy" and trace.decoding.max_new_tokens == 16
    assert trace.decoding.stop_reason == "other"  # eos, `until` or max_gen_toks: not logged
    assert trace.top_k is None  # text only: no logged margin
    extras = trace.config.extras
    assert extras["tokenization"] == TOKENIZATION and extras["import_format"] == "lm-eval"
    assert extras["chat_template"] == "none"
    assert (trace.config.dtype, trace.config.device, trace.config.batch_size) == ("fp32", "cpu", 1)
    assert trace.config.engine.name == "transformers"
    assert trace.config.engine.version == "5.23.0"


def test_repeats_and_sampling_are_kept_apart() -> None:
    s = sample(resps=[[" 4", " 5"]])
    s["arguments"]["gen_args_0"]["arg_1"].update(do_sample=True, temperature=0.7)
    first, second = parse_lm_eval_sample(s, task="arith", tokenizer=TOKENIZER, results=RESULTS)
    assert first.external_id != second.external_id
    assert first.strategy == second.strategy == "sample"


def test_the_bos_string_in_the_context_is_not_doubled() -> None:
    bos = TOKENIZER.bos_token
    s = sample()
    s["arguments"]["gen_args_0"]["arg_0"] = f"{bos}Question: 2 + 2 =\nAnswer:"
    [gen] = parse_lm_eval_sample(s, task="arith", tokenizer=TOKENIZER, results=RESULTS)
    assert list(gen.prompt_token_ids).count(TOKENIZER.bos_token_id) == 1


def test_an_empty_response_gives_no_trace_and_is_counted() -> None:
    # The tiny model often answers "\n" at once: lm-eval cuts it at `until`, leaving "".
    skipped: list[str] = []
    gens = parse_lm_eval_sample(
        sample(resps=[["", " 4"]]),
        task="arith",
        tokenizer=TOKENIZER,
        results=RESULTS,
        skipped=skipped,
    )
    assert len(gens) == 1 and skipped == ["sample.resps[0][0]"]


def test_a_loglikelihood_sample_is_not_a_generation() -> None:
    s = sample(
        arguments={"gen_args_0": {"arg_0": "Q: 2+2?", "arg_1": " 4"}}, resps=[[[-0.5, True]]]
    )
    with pytest.raises(NotAGeneration):
        parse_lm_eval_sample(s, task="arith", tokenizer=TOKENIZER, results=RESULTS)


@pytest.mark.parametrize(
    ("edits", "field"),
    [
        ({"arguments": None}, "sample.arguments"),
        ({"resps": [[" 4"], [" 5"]]}, "sample.resps"),
        ({"resps": [[7]]}, "sample.resps[0][0]"),
    ],
)
def test_bad_samples_are_refused_naming_the_field(edits: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as err:
        parse_lm_eval_sample(sample(**edits), task="arith", tokenizer=TOKENIZER, results=RESULTS)
    assert err.value.field == field


def test_the_results_file_says_only_what_it_states() -> None:
    assert context_from_results({}) == {}
    ctx = context_from_results(
        {
            "config": {
                "model_args": "pretrained=x,dtype=bfloat16",
                "batch_size": "auto",
                "device": "cuda:0",
            }
        }
    )
    assert ctx["dtype"] == "bf16" and ctx["device"] == "cuda" and "batch_size" not in ctx
    assert task_from_filename("samples_gsm8k_cot_2024-05-01T12-00-00.123.jsonl") == "gsm8k_cot"
    assert task_from_filename("results_2024.json") is None


def test_the_stop_strings_sampling_fields_and_seeds_are_kept_under_their_names() -> None:
    # `until` and the sampling fields of the sample's gen_kwargs (arg_1), the seeds of the
    # results JSON's config (lm_eval/evaluator.py: random_seed, numpy_seed, torch_seed,
    # fewshot_seed): kept, not dropped.
    s = sample()
    s["arguments"]["gen_args_0"]["arg_1"].update(until=["\n", "Question:"], top_p=0.95)
    [gen] = parse_lm_eval_sample(s, task="arith", tokenizer=TOKENIZER, results=RESULTS)
    extras = build_trace(gen, context(), "lm-eval").config.extras
    assert extras["until"] == '["\\n","Question:"]'
    assert (extras["do_sample"], extras["temperature"], extras["top_p"]) == (False, 0.0, 0.95)
    seeds = [extras[k] for k in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")]
    assert seeds == [0, 1234, 1234, 1234]
    # An older results JSON without seeds: none invented.
    older = {**RESULTS, "config": {k: v for k, v in RESULTS["config"].items() if "seed" not in k}}
    [gen] = parse_lm_eval_sample(sample(), task="arith", tokenizer=TOKENIZER, results=older)
    assert not {"random_seed", "torch_seed"} & set(gen.extras)


#: A results JSON of `lm_eval --model vllm` (lm_eval/models/vllm_causallms.py: `VLLM`'s
#: `model_args` `pretrained`, `dtype`, `tensor_parallel_size`, `add_bos_token`; no
#: `model_dtype`, which only HFLM's get_model_info writes).
VLLM_RESULTS: dict[str, Any] = {
    **RESULTS,
    "config": {
        **{k: v for k, v in RESULTS["config"].items() if k != "model_dtype"},
        "model": "vllm",
        "model_args": "pretrained=./ckpt,dtype=bfloat16,tensor_parallel_size=2,"
        "gpu_memory_utilization=0.8",
        "batch_size": "auto",
        "device": "cuda",
    },
}


def test_a_run_on_lm_evals_vllm_backend_is_recorded_as_vllm_ran_it() -> None:
    ctx = context_from_results(VLLM_RESULTS)
    assert ctx["engine"] == {"name": "vllm"} and ctx["tp_degree"] == 2 and ctx["dtype"] == "bf16"
    # vLLM batches the requests lm-eval hands it dynamically: not a batch size that ran.
    assert "batch_size" not in ctx
    [gen] = parse_lm_eval_sample(sample(), task="arith", tokenizer=TOKENIZER, results=VLLM_RESULTS)
    trace = build_trace(gen, context(VLLM_RESULTS), "lm-eval")
    assert (trace.config.engine.name, trace.config.tp_degree) == ("vllm", 2)
    assert trace.config.batch_size is None and trace.config.extras["request_batch"] == "auto"
    assert "batch_size" in str(trace.config.extras["unknown"])
    # vLLM's tok_encode adds no special tokens (add_bos_token=False by default): no BOS.
    text = "Question: 2 + 2 =\nAnswer:"
    assert trace.prompt_token_ids == TOKENIZER(text, add_special_tokens=False)["input_ids"]
    assert TOKENIZER.decode(trace.output_token_ids) == " 4\n"
    # An explicit add_bos_token=True in model_args is honoured.
    config = {**VLLM_RESULTS["config"], "model_args": "pretrained=./ckpt,add_bos_token=True"}
    [gen] = parse_lm_eval_sample(
        sample(), task="arith", tokenizer=TOKENIZER, results={**VLLM_RESULTS, "config": config}
    )
    assert list(gen.prompt_token_ids or ()) == TOKENIZER(text)["input_ids"]
    # SamplingParams takes the temperature and ignores do_sample: 0.7 samples.
    s = sample()
    s["arguments"]["gen_args_0"]["arg_1"].update(do_sample=False, temperature=0.7)
    [gen] = parse_lm_eval_sample(s, task="arith", tokenizer=TOKENIZER, results=VLLM_RESULTS)
    assert gen.strategy == "sample"
