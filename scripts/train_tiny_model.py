"""Train replay-audit's own tiny Llama on the Python standard library's source files.

No model hub is reachable where this project is built and tested, so the demo and the tests use a
model trained here, on a corpus every machine with Python has offline: the ``*.py`` files of
``sysconfig.get_paths()["stdlib"]``. The script

1. lists the corpus files (sorted by relative path, tests/IDLE/data-table modules left out) and
   splits them into train and held-out by a hash of the relative path (about 1 file in 10 held out);
2. trains a 4,096-token byte-level BPE tokenizer (``tokenizers``) on the training files;
3. trains a small ``LlamaForCausalLM`` (fp32, AdamW, linear warmup + cosine decay) on random
   256-token windows of the training stream for a fixed number of steps;
4. prints train and held-out loss and writes a Hugging Face checkpoint (float32 safetensors,
   tokenizer.json, configs) plus a fixed prompt set drawn from the held-out files.

For a given Python standard library and torch version the result is deterministic: fixed seeds,
two torch threads, deterministic algorithms, a single-threaded tokenizer trainer and a step budget
(``--steps``). ``--minutes`` stops on wall-clock time instead, which is not reproducible.

Usage (from the repository root)::

    .venv/bin/python scripts/train_tiny_model.py --steps 900

Larger, on a GPU (the screening's 12 x 768 model, `benchmarks/gpu_screen.sh`)::

    python scripts/train_tiny_model.py --device cuda --amp bf16 --layers 12 --hidden 768 \
        --intermediate 2048 --heads 12 --kv-heads 4 --batch-size 32 --lr 1e-3 --minutes 4 \
        --out .models/py-12x768 --prompts-out .models/py-12x768/prompts.jsonl

``--corpus DIR`` trains on another directory of Python files than the standard library. On CUDA,
``--amp bf16`` trains under BF16 autocast (weights and optimizer state stay FP32, as in
mixed-precision pretraining; the checkpoint is saved in FP32 unless ``--save-dtype bf16``), and
the final losses are measured under it too. ``--seq-len`` sets the training windows (256) and
``--max-positions`` the checkpoint's ``max_position_embeddings`` (512): a model that must read
traces of 512 tokens and more (``benchmarks/e2e_audit.py``'s 1B Llama) trains on 512-token
windows with room for longer ones.

See docs/model.md.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "replay_audit" / "assets" / "tiny-llama"
DEFAULT_PROMPTS_OUT = REPO_ROOT / "replay_audit" / "assets" / "prompts.jsonl"

VOCAB_SIZE = 4096
# Byte-level BPE never needs <unk>; <pad> exists so generate() and batching have a real pad id.
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
SEQ_LEN = 256
MAX_POSITIONS = 512

# Path components that leave a file out of the corpus: test suites (mostly fixtures and
# assertions), IDLE and demos, vendored third-party code, and generated data tables
# (pydoc_data/topics.py is one 750 kB string literal; encodings/ is mostly codec tables).
EXCLUDED_PARTS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "turtledemo",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "pydoc_data",
        "encodings",
        "ensurepip",
        "__phello__",
    }
)
HELD_OUT_MODULUS = 10  # a file is held out when sha256(relative path)[0] % 10 == 0

N_PROMPTS = 64
PROMPT_MIN_TOKENS = 20
PROMPT_TARGET_TOKENS = 28  # stop adding lines once a prompt has at least this many tokens
PROMPT_MAX_TOKENS = 60
PROMPTS_PER_FILE = 2


@dataclass(frozen=True)
class CorpusFile:
    """One source file of the corpus: its path relative to the stdlib root and its text."""

    rel_path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The train/held-out split of the standard library's source files."""

    stdlib_root: Path
    train: list[CorpusFile]
    held_out: list[CorpusFile]


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str) -> bool:
    """Whether a corpus file (relative POSIX path) belongs to the held-out split."""
    return hashlib.sha256(rel_path.encode()).digest()[0] % HELD_OUT_MODULUS == 0


def _is_excluded(rel_parts: tuple[str, ...]) -> bool:
    dirs, name = rel_parts[:-1], rel_parts[-1]
    if any(part in EXCLUDED_PARTS or part.startswith("config-") for part in dirs):
        return True
    return name.startswith("test_")


def load_corpus(root: Path | None = None) -> Corpus:
    """Read the corpus files sorted by relative path and split them into train and held-out."""
    root = stdlib_root() if root is None else root
    files: list[tuple[str, Path]] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if path.is_file() and not _is_excluded(rel.parts):
            files.append((rel.as_posix(), path))
    files.sort()
    train: list[CorpusFile] = []
    held_out: list[CorpusFile] = []
    for rel_path, path in files:
        # The stdlib is UTF-8; "replace" keeps the run going on an odd distribution's file.
        text = path.read_bytes().decode("utf-8", errors="replace")
        (held_out if is_held_out(rel_path) else train).append(CorpusFile(rel_path, text))
    return Corpus(stdlib_root=root, train=train, held_out=held_out)


def train_tokenizer(files: list[CorpusFile]) -> Tokenizer:
    """Train the byte-level BPE tokenizer (vocabulary 4,096, ids 0-2 are <s>, </s>, <pad>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((f.text for f in files), trainer=trainer)
    # Llama convention: every encoded text starts with <s>, as every training file does.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token!r} did not get id {token_id}")
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"vocabulary has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tokenizer


def wrap_tokenizer(
    tokenizer: Tokenizer, max_positions: int = MAX_POSITIONS
) -> PreTrainedTokenizerFast:
    """The transformers view of the tokenizer, as AutoTokenizer.from_pretrained will load it."""
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        model_max_length=max_positions,
        clean_up_tokenization_spaces=False,
    )


def token_stream(tokenizer: Tokenizer, files: list[CorpusFile]) -> torch.Tensor:
    """All files concatenated as ``<s> file </s>`` into one int64 tensor of token ids."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch([f.text for f in files], add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def eval_windows(
    stream: torch.Tensor, max_windows: int | None = None, seq_len: int = SEQ_LEN
) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows of a stream, for a reproducible loss."""
    n = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    starts = torch.arange(n) * seq_len
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int = 32) -> float:
    """Token-weighted mean next-token cross-entropy (nats) of the model over the windows."""
    model.eval()  # type: ignore[no-untyped-call]
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i : i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def build_model(
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    max_positions: int = MAX_POSITIONS,
) -> LlamaForCausalLM:
    """A freshly initialised fp32 Llama with an untied lm_head (interventions recompute it)."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,  # RoPE: the default, theta 10,000
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=True,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)  # float32, torch's default dtype


def lr_at(step: int, total: int, peak: float, warmup: int, floor_ratio: float = 0.1) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``floor_ratio * peak`` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    # Held at the floor past `total` (a --minutes run can outlast its estimated schedule).
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: LlamaForCausalLM, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )


def _dedent_from(lines: list[str], indent: int) -> list[str]:
    out = []
    for line in lines:
        out.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
    return out


def extract_prompts(tokenizer: Tokenizer, held_out: list[CorpusFile]) -> list[dict[str, str]]:
    """64 function-definition beginnings from held-out files, 20-60 tokens each (without <s>).

    Each prompt starts at a ``def`` line (dedented) and takes whole lines until it holds at least
    PROMPT_TARGET_TOKENS tokens; it never ends in a newline. Candidates are ranked by a hash of
    their id, at most PROMPTS_PER_FILE per file, so the choice is deterministic and spread out.
    """
    candidates: list[tuple[str, str, str]] = []  # (rank key, id, prompt)
    for f in held_out:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines()
        seen_lines: set[int] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            start = node.lineno - 1
            if start in seen_lines:
                continue
            seen_lines.add(start)
            def_line = lines[start]
            indent = len(def_line) - len(def_line.lstrip())
            body = _dedent_from(lines[start : start + 20], indent)
            prompt = ""
            n_tokens = 0
            for line in body:
                candidate = line if not prompt else prompt + "\n" + line
                n = len(tokenizer.encode(candidate, add_special_tokens=False).ids)
                if n > PROMPT_MAX_TOKENS:
                    break
                prompt, n_tokens = candidate, n
                if n_tokens >= PROMPT_TARGET_TOKENS and line.strip():
                    break
            prompt = prompt.rstrip()
            n_tokens = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
            if not PROMPT_MIN_TOKENS <= n_tokens <= PROMPT_MAX_TOKENS:
                continue
            prompt_id = f"{f.rel_path}:{node.lineno}"
            rank = hashlib.sha256(prompt_id.encode()).hexdigest()
            candidates.append((rank, prompt_id, prompt))
    candidates.sort()
    chosen: list[tuple[str, str]] = []
    per_file: dict[str, int] = {}
    for _, prompt_id, prompt in candidates:
        rel_path = prompt_id.rsplit(":", 1)[0]
        if per_file.get(rel_path, 0) >= PROMPTS_PER_FILE:
            continue
        per_file[rel_path] = per_file.get(rel_path, 0) + 1
        chosen.append((prompt_id, prompt))
        if len(chosen) == N_PROMPTS:
            break
    if len(chosen) < N_PROMPTS:
        raise RuntimeError(f"only {len(chosen)} prompts found in the held-out files")
    # Present them in file order: easier to read and to diff.
    chosen.sort(key=lambda item: (item[0].rsplit(":", 1)[0], int(item[0].rsplit(":", 1)[1])))
    return [{"id": prompt_id, "prompt": prompt} for prompt_id, prompt in chosen]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory")
    parser.add_argument("--prompts-out", type=Path, default=DEFAULT_PROMPTS_OUT)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="optimizer steps (reproducible)")
    budget.add_argument("--minutes", type=float, default=None, help="wall-clock budget (not)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--amp", choices=("none", "bf16"), default="none", help="autocast dtype (CUDA only)"
    )
    parser.add_argument(
        "--corpus", type=Path, default=None, help="directory of *.py files (default: the stdlib)"
    )
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--seq-len", type=int, default=SEQ_LEN, help="tokens of a training window (256)"
    )
    parser.add_argument(
        "--max-positions",
        type=int,
        default=MAX_POSITIONS,
        help="the checkpoint's max_position_embeddings and the tokenizer's model_max_length",
    )
    parser.add_argument(
        "--save-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="dtype of the saved weights (training keeps FP32 master weights either way)",
    )
    args = parser.parse_args(argv)
    if args.seq_len > args.max_positions:
        parser.error("--seq-len must not exceed --max-positions")
    if args.steps is None and args.minutes is None:
        args.steps = DEFAULT_STEPS
    return args


# Calibrated so that training takes about 5 minutes on the project's 2-core machine.
DEFAULT_STEPS = 900


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The BPE trainer is reproducible single-threaded; fix it before any tokenizers call.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # Deterministic on the CPU (the bundled model is reproducible); on CUDA a kernel without a
    # deterministic implementation warns instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    corpus = load_corpus(args.corpus)
    n_bytes = sum(len(f.text.encode()) for f in corpus.train)
    print(
        f"corpus {corpus.stdlib_root}: {len(corpus.train)} train files ({n_bytes / 1e6:.2f} MB), "
        f"{len(corpus.held_out)} held-out files"
    )
    tokenizer = train_tokenizer(corpus.train)
    train_stream = token_stream(tokenizer, corpus.train)
    held_stream = token_stream(tokenizer, corpus.held_out)
    print(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, train {train_stream.numel():,} tokens "
        f"({n_bytes / train_stream.numel():.2f} bytes/token), held-out {held_stream.numel():,} "
        f"tokens ({time.perf_counter() - t_start:.1f}s)"
    )

    seq_len = args.seq_len
    model = build_model(
        args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads, args.max_positions
    )
    torch.nn.Module.to(model, device)
    autocast = torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16"
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    held_windows = eval_windows(held_stream, seq_len=seq_len)
    # A fixed sample of training windows, for a train loss comparable with the held-out one.
    train_eval_starts = torch.randint(
        0, train_stream.numel() - seq_len - 1, (held_windows.shape[0],), generator=generator
    )
    train_windows = torch.stack([train_stream[s : s + seq_len + 1] for s in train_eval_starts])

    total_steps = args.steps if args.steps is not None else 10**9
    deadline = None if args.minutes is None else time.perf_counter() + 60 * args.minutes
    # With a time budget the schedule needs a length: estimate it from the first steps.
    schedule_steps = args.steps if args.steps is not None else DEFAULT_STEPS
    probe_steps = 20
    model.train()
    t_train = time.perf_counter()
    running = 0.0
    step = 0
    for step in range(total_steps):
        if deadline is not None and time.perf_counter() > deadline:
            break
        if deadline is not None and step == probe_steps:
            per_step = (time.perf_counter() - t_train) / probe_steps
            schedule_steps = max(probe_steps + 1, int(60 * args.minutes / per_step))
        lr = lr_at(step, schedule_steps, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            0, train_stream.numel() - seq_len - 1, (args.batch_size,), generator=generator
        )
        batch = torch.stack([train_stream[s : s + seq_len + 1] for s in starts]).to(device)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0:
            elapsed = time.perf_counter() - t_train
            print(
                f"step {step + 1:5d}  lr {lr:.2e}  train loss {running / args.log_every:.3f}  "
                f"{elapsed:.0f}s ({1000 * elapsed / (step + 1):.0f} ms/step)",
                flush=True,
            )
            running = 0.0
    else:
        step = total_steps
    steps_done = step
    train_seconds = time.perf_counter() - t_train

    with autocast:
        train_loss = mean_loss(model, train_windows.to(device))
        held_loss = mean_loss(model, held_windows.to(device))
    print(
        f"done: {steps_done} steps in {train_seconds:.0f}s; train loss {train_loss:.4f}, "
        f"held-out loss {held_loss:.4f} (uniform {math.log(VOCAB_SIZE):.4f})"
    )

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        do_sample=False,
    )
    model.config._attn_implementation = "eager"
    torch.nn.Module.to(model, "cpu")
    if args.save_dtype == "bf16":
        torch.nn.Module.to(model, torch.bfloat16)
    model.save_pretrained(out)
    wrap_tokenizer(tokenizer, args.max_positions).save_pretrained(out)
    # transformers 5 writes its own class name; the generic name loads in 4.x and 5.x alike.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")

    prompts = extract_prompts(tokenizer, corpus.held_out)
    args.prompts_out.parent.mkdir(parents=True, exist_ok=True)
    with args.prompts_out.open("w", encoding="utf-8") as fh:
        for record in prompts:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")

    summary = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "steps": steps_done,
        "parameters": n_params,
        "train_files": len(corpus.train),
        "held_out_files": len(corpus.held_out),
        "train_tokens": train_stream.numel(),
        "held_out_tokens": held_stream.numel(),
        "train_loss": round(train_loss, 4),
        "held_out_loss": round(held_loss, 4),
        "train_seconds": round(train_seconds, 1),
        "model_safetensors_sha256": sha256_file(out / "model.safetensors"),
        "tokenizer_json_sha256": sha256_file(out / "tokenizer.json"),
        "prompts": len(prompts),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
