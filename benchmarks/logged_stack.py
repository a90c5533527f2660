"""Bit for bit with the stack that logged it (issue 31): do a user's plain `generate()` traces
replay exactly in their own logged configuration, and does `replay-audit generate` log what
plain `generate()` gives?

    python benchmarks/logged_stack.py --model DIR --work /tmp/ls --device cuda \
        --prompts 24 --tokens 128 --batches 4,8 > logged_stack.json

On a real pretrained chat checkpoint (SmolLM2-135M-Instruct: scripts/build_smollm2.py), with
chat prompts rendered by its own template, for each dtype (bf16, fp16):

1. **plain**: what a user runs, in a process of its own: `AutoModelForCausalLM.from_pretrained
   (dir, dtype=...)` moved to the device, torch's defaults untouched, and
   `model.generate(**inputs, max_new_tokens=N, do_sample=False, return_dict_in_generate=True,
   output_logits=True)`, batch 1 for every prompt, then left-padded batches of each
   `--batches` size (the tokenizer's `padding_side="left"`); every output saved with
   `torch.save` as it came (the `hf` import's input);
2. **generate**: `replay-audit generate --batch-size B` over the same prompts: its tokens and its
   logged top-1 logits against plain's, bit for bit (prompt ids included);
3. **import**: `replay-audit import --format hf` of plain's files (`--config dtype=...
   --config decoding.strategy=greedy`, nothing else: the rest comes from the files);
4. **CLI replay**: `replay-audit replay --dtype <logged> --batch-size B --mode decode
   --no-reproduce` of the imported traces: each trace's replay in its logged configuration
   against its logged tokens (exact, or t*);
5. **API replay** (batch 1): the imported traces posted to an embedded service
   (`replay-audit serve`'s app, SQLite, in-process runner) and replayed with
   `compare_with: "self"`, `engine_check: "off"`: the run's own statistics.

The plain runs and the CLI commands of each phase run as concurrent processes (a 135M model's
decode is launch-bound: the GPU idles between kernels); concurrency changes no kernel choice.
One JSON object on stdout; the work directory keeps every file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Chat prompts (a user turn each; some with a system turn), as users send them.
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is and why lookups are fast.",
    "Give me three tips for a job interview.",
    "How do vaccines train the immune system?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "How does compound interest work? Give an example.",
    "What are the main causes of climate change?",
    "Translate 'Good morning, how are you?' into Spanish and French.",
    "Describe how a bill becomes a law in the United States.",
    "What is photosynthesis?",
    "Suggest a name for a coffee shop and explain why.",
    "How do I reverse a string in JavaScript?",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion to a ten-year-old.",
    "What were the causes of the First World War?",
    "Write a limerick about a cat who loves cheese.",
    "How do airplanes stay in the air?",
    "List five healthy breakfast ideas.",
    "What is the Pythagorean theorem and where is it used?",
    "Write a polite email declining a meeting invitation.",
    "What is machine learning, in two paragraphs?",
    "How can I improve my sleep?",
    "Explain the difference between weather and climate.",
    "What is a black hole?",
    "Give a recipe for a simple tomato pasta sauce.",
    "Why do we have leap years?",
    "What is the role of mitochondria in a cell?",
    "Write a short story opening line set on Mars.",
]
SYSTEM = "You are a helpful assistant."
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def messages(i: int) -> list[dict[str, str]]:
    turn = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    return ([{"role": "system", "content": SYSTEM}] if i % 3 == 2 else []) + turn


def plain(args: argparse.Namespace) -> None:
    """Step 1 in this process: the user's plain generate() runs, saved as they come."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, DTYPES[args.dtype])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    convs = [messages(i) for i in range(args.prompts)]
    for size in [1, *args.batches]:
        folder = args.work / f"plain-{args.dtype}-b{size}"
        folder.mkdir(parents=True, exist_ok=True)
        for start in range(0, len(convs) - size + 1, size):
            chunk = convs[start : start + size]
            enc = tokenizer.apply_chat_template(
                chunk if size > 1 else chunk[0],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
                padding=size > 1,
            ).to(args.device)
            out = model.generate(
                **enc,
                max_new_tokens=args.tokens,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )
            # The file a user keeps: the output as it came (batch 1), or its fields with the
            # call's inputs beside them (a padded batch: the mask is not in the output).
            saved: Any = (
                out
                if size == 1
                else {**out, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
            )
            torch.save(saved, folder / f"{start:03d}.pt")


def cli(*argv: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "replay_audit", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def wait(procs: dict[str, subprocess.Popen[bytes]], log: dict[str, Any]) -> None:
    for name, p in procs.items():
        out, _ = p.communicate()
        log[name] = {"rc": p.returncode, "tail": (out or b"").decode(errors="replace")[-1500:]}
        if p.returncode != 0:
            print(f"{name}: exit {p.returncode}\n{log[name]['tail']}", file=sys.stderr)


def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def plain_rows(folder: Path, eos: int) -> list[dict[str, Any]]:
    """Each row of plain's saved outputs: prompt ids (padding dropped), new tokens to the first
    eos (kept), the raw top-1 logit of each step."""

    from replay_audit.imports.hf_context import load_generate_output

    rows = []
    for f in sorted(folder.glob("*.pt")):
        d = load_generate_output(f)
        width = d["sequences"].shape[1] - len(d["logits"])
        for r in range(d["sequences"].shape[0]):
            mask = d["attention_mask"][r].bool() if "attention_mask" in d else slice(None)
            ids = d["input_ids"] if "input_ids" in d else d["sequences"][:, :width]
            new = d["sequences"][r, width:].tolist()
            if eos in new:
                new = new[: new.index(eos) + 1]
            rows.append(
                {
                    "prompt": ids[r][mask].tolist(),
                    "output": new,
                    "top1": [float(d["logits"][t][r].float().max()) for t in range(len(new))],
                }
            )
    return rows


def compare_generate(
    plain_: Sequence[dict[str, Any]], logged: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """`replay-audit generate`'s traces against plain's rows, in order."""
    same_tokens = same_logits = 0
    firsts = []
    for p, t in zip(plain_, logged, strict=False):
        tokens = p["prompt"] == t["prompt_token_ids"] and p["output"] == t["output_token_ids"]
        top1 = [row[0] for row in t["top_k"]["logits"]]
        logits = tokens and top1 == p["top1"]
        same_tokens += tokens
        same_logits += logits
        if not tokens:
            a, b = p["output"], t["output_token_ids"]
            firsts.append(
                next(
                    (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)),
                )
            )
    return {
        "n": len(plain_),
        "traces": len(logged),
        "same_tokens": same_tokens,
        "same_top1_logits_bitwise": same_logits,
        "first_differences": firsts,
        "attention_backends": sorted(
            {json.dumps(t["config"]["extras"].get("attention_backends")) for t in logged}
        ),
    }


#: What each replay's resolved arm says ran (`arms.b.resolved`), counted over its traces.
RAN = ("dtype", "batch_size", "attn_kernel", "kernel_source", "attention_backends", "kv_cache")


def replay_figures(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A self-replay's results (comparison 0, the CLI's file or the API's pages alike): exact
    traces, the t* and category of the others, and what ran."""
    main = [r for r in results if r["comparison"] == 0]
    ran = Counter(
        json.dumps(
            {k: ((r.get("arms") or {}).get("b") or {}).get("resolved", {}).get(k) for k in RAN}
        )
        for r in main
    )
    return {
        "n": len(main),
        "exact": sum(bool(r["exact_match"]) for r in main),
        "failed": sum(r["status"] != "ok" for r in main),
        "divergences": sorted(
            (r["first_divergence_step"], r["category"]) for r in main if r["exact_match"] is False
        ),
        "baselines": dict(Counter(r["baseline"] for r in main)),
        "ran": {k: v for k, v in ran.items()},
    }


def api(args: argparse.Namespace) -> None:
    """Step 5 in this process: the imported batch-1 traces through the embedded service."""
    import httpx

    from replay_audit.cli.database import ready_database
    from replay_audit.cli.demo import _demo_key, _serving
    from replay_audit.config import get_settings

    settings = get_settings()
    ready_database(settings, migrate=True)
    from rich.console import Console

    key = _demo_key(settings, Console(stderr=True))
    report: dict[str, Any] = {}
    with (
        _serving(settings, 0) as (_, base),
        httpx.Client(base_url=base, headers={"X-API-Key": key}, timeout=120) as client,
    ):
        runs = {}
        for dtype in args.dtypes:
            traces = jsonl(args.work / f"imported-{dtype}-b1.jsonl")
            r = client.post("/v1/traces:batch", json={"traces": traces})
            r.raise_for_status()
            ids = [x["id"] for x in r.json()["results"]]
            r = client.post(
                "/v1/replays",
                json={
                    "name": f"self-replay of plain generate() {dtype}",
                    "trace_ids": ids,
                    "compare_with": "self",
                    "engine_check": "off",
                    "mode": "decode",
                },
            )
            r.raise_for_status()
            runs[dtype] = r.json()["id"]
        for dtype, run_id in runs.items():
            while True:
                run = client.get(f"/v1/replays/{run_id}").json()
                if run["status"] in ("done", "failed"):
                    break
                time.sleep(0.5)
            items: list[dict[str, Any]] = []
            cursor = None
            while True:
                page = client.get(
                    f"/v1/replays/{run_id}/results",
                    params={"limit": 500, **({"cursor": cursor} if cursor else {})},
                ).json()
                items += page["items"]
                if not (cursor := page["next_cursor"]):
                    break
            agreed = run["statistics"]["comparisons"][0]["categories"]["agreed"]
            report[dtype] = {
                "run": run_id,
                "status": run["status"],
                **replay_figures(items),
                "statistics_agreed": [agreed["successes"], agreed["n"]],
            }
    json.dump(report, sys.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", nargs="?", choices=["all", "plain", "api"], default="all")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[4, 8])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16", "fp16"])
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    args = ap.parse_args()
    if args.step == "plain":
        return plain(args)
    if args.step == "api":
        return api(args)
    args.work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": str(args.threads),
        "REPLAY_AUDIT_TORCH_THREADS": str(args.threads),
    }
    prompts = args.work / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i:02d}", "messages": messages(i)}) + "\n"
            for i in range(args.prompts)
        )
    )
    sizes = [1, *args.batches]
    log: dict[str, Any] = {}
    report: dict[str, Any] = {
        "model": str(args.model),
        "device": args.device,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "batches": sizes,
        "seconds": {},
    }
    me = [sys.executable, str(Path(__file__).resolve())]
    common = [
        "--model",
        str(args.model.resolve()),
        "--work",
        str(args.work.resolve()),
        "--device",
        args.device,
        "--prompts",
        str(args.prompts),
        "--tokens",
        str(args.tokens),
        "--batches",
        ",".join(map(str, args.batches)),
    ]

    t0 = time.perf_counter()  # 1 and 2: plain and replay-audit generate, all at once
    procs = {
        f"plain-{d}": subprocess.Popen([*me, "plain", *common, "--dtype", d], env=env)
        for d in args.dtypes
    }
    for d in args.dtypes:
        for b in sizes:
            usable = args.prompts - args.prompts % b
            procs[f"generate-{d}-b{b}"] = cli(
                "generate",
                "--model",
                str(args.model),
                "--prompts",
                str(prompts),
                "--limit",
                str(usable),
                "--out",
                str(args.work / f"generated-{d}-b{b}.jsonl"),
                "--dtype",
                d,
                "--max-new-tokens",
                str(args.tokens),
                "--device",
                args.device,
                "--batch-size",
                str(b),
                env=env,
            )
    wait(procs, log)
    report["seconds"]["plain_and_generate"] = round(time.perf_counter() - t0, 1)

    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(args.model).eos_token_id
    t0 = time.perf_counter()  # 3: the hf import of plain's files
    procs = {}
    for d in args.dtypes:
        for b in sizes:
            files = sorted(map(str, (args.work / f"plain-{d}-b{b}").glob("*.pt")))
            procs[f"import-{d}-b{b}"] = cli(
                "import",
                "--format",
                "hf",
                *files,
                "--model",
                str(args.model),
                "--config",
                f"dtype={d}",
                "--config",
                "decoding.strategy=greedy",
                "--out",
                str(args.work / f"imported-{d}-b{b}.jsonl"),
                env=env,
            )
    wait(procs, log)
    report["seconds"]["import"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()  # 4 and 5: CLI replays (every batch size) and the API (batch 1)
    procs = {}
    for d in args.dtypes:
        for b in sizes:
            procs[f"replay-{d}-b{b}"] = cli(
                "replay",
                str(args.work / f"imported-{d}-b{b}.jsonl"),
                "--model",
                str(args.model),
                "--dtype",
                d,
                "--batch-size",
                str(b),
                "--mode",
                "decode",
                "--no-reproduce",
                "--device",
                args.device,
                "--out",
                str(args.work / f"replayed-{d}-b{b}.jsonl"),
                "--summary-json",
                str(args.work / f"summary-{d}-b{b}.json"),
                env=env,
            )
    api_out = open(args.work / "api.json", "w")  # noqa: SIM115
    procs["api"] = subprocess.Popen(
        [*me, "api", *common, "--dtypes", ",".join(args.dtypes)],
        env={**env, "REPLAY_AUDIT_MODEL_DIRS": str(args.model.resolve())},
        stdout=api_out,
        cwd=args.work,
    )  # ./var: its database
    wait(procs, log)
    api_out.close()
    report["seconds"]["replay"] = round(time.perf_counter() - t0, 1)

    for d in args.dtypes:
        for b in sizes:
            key = f"{d}-b{b}"
            rows = plain_rows(args.work / f"plain-{d}-b{b}", eos)
            report[key] = {
                "plain_rows": len(rows),
                "generate_vs_plain": compare_generate(
                    rows, jsonl(args.work / f"generated-{key}.jsonl")
                ),
                "imported": len(jsonl(args.work / f"imported-{key}.jsonl")),
                "cli_self_replay": replay_figures(jsonl(args.work / f"replayed-{key}.jsonl")),
            }
    api_text = (args.work / "api.json").read_text()
    report["api_self_replay"] = json.loads(api_text) if api_text.strip() else None
    report["failed_steps"] = {k: v for k, v in log.items() if v["rc"] != 0}
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
