"""Is a user's plain `generate()` reproducible run to run, under torch's default SDPA backends?

    python benchmarks/sdpa_determinism.py --tinyllama --device cuda --tokens 320 > det.json
    python benchmarks/sdpa_determinism.py --model DIR --device cuda --tokens 320 > det.json

For each setting (torch's defaults; deterministic algorithms on; cuDNN attention off), each
prompt is generated twice by plain `model.generate()` (greedy, raw logits) and the two runs'
logits compared step by step with `torch.equal`: the first step where they differ, if any, and
the SDPA backends the calls ran (`replay_audit.engine.attention`). A replay cannot be more
faithful to a log than the logging stack is to itself: where plain `generate()` differs from
itself after some length, so does every replay of its traces. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import random_tinyllama

from replay_audit.engine import attention
from replay_audit.engine.loading import ProcessNumerics, load_model, resolve_device

SETTINGS = {
    "defaults": ProcessNumerics(),
    "deterministic": ProcessNumerics(deterministic=True),
    "flash": ProcessNumerics(sdpa_backend="flash"),
}


def run(model: Any, prompt: list[int], tokens: int, device: torch.device) -> list[torch.Tensor]:
    x = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return [z[0].float() for z in out.logits]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tinyllama", action="store_true")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS))
    args = ap.parse_args()
    device = resolve_device(args.device)
    if args.tinyllama:
        model = random_tinyllama(args.dtype, args.device)
    else:
        model, _ = load_model(args.model, args.dtype, "sdpa", device)
    rng = random.Random(7)
    vocab = int(model.config.vocab_size)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.choice((8, 32, 64)))]
        for _ in range(args.prompts)
    ]
    out: dict[str, Any] = {"torch": torch.__version__, "tokens": args.tokens}
    for name in args.settings:
        rows = []
        with SETTINGS[name].applied(), attention.observe() as seen:
            for p in prompts:
                a, b = run(model, p, args.tokens, device), run(model, p, args.tokens, device)
                first = next(
                    (t for t, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)),
                    None,
                )
                rows.append({"prompt_len": len(p), "first_run_to_run_difference": first})
        out[name] = {"backends": seen.backends(), "prompts": rows}
        print(name, out[name], file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
