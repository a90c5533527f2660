"""A tiny random Llama checkpoint for fast tests, and simulated providers of a checkpoint (RTN
weights, a swapped or misconfigured copy, an FP8 KV cache) for the verification's tests and
benchmarks (imports torch and transformers where called).

Its weights are exactly representable in BF16 and in FP16 (rounded to BF16, magnitudes below
FP16's smallest normal flushed to zero), so an engine in either format holds the very same lm_head
values: what differs between the arms is arithmetic, not storage. Its tokenizer is byte-level
(256 byte tokens and `</s>` = 256), so any text round-trips.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Token id of `</s>` in the tiny checkpoint's tokenizer.
TINY_EOS_ID = 256
#: The attention function of the simulated FP8 KV-cache provider (`fp8_kv_cache`), as registered
#: with transformers' `AttentionInterface`.
FP8_KV_ATTENTION = "sdpa_fp8_kv"
#: The largest finite float8_e4m3fn value: the cache saturates there, as vLLM's FP8 conversion
#: does (`__NV_SATFINITE`).
E4M3_MAX = 448.0


def make_tiny_checkpoint(
    path: str | Path,
    *,
    vocab_size: int = 272,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    head_scale: float = 8.0,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
) -> Path:
    """Write a random `LlamaForCausalLM` (float32 safetensors) and a byte-level tokenizer to
    `path`. `head_scale` multiplies the lm_head weights so the next-token distributions are
    peaked like a trained model's, with occasional close calls. A tensor-parallel degree must
    divide the head counts (4 and 2 by default: TP 2), `hidden_size` and the vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=1024,
        initializer_range=0.05,
        tie_word_embeddings=False,
        eos_token_id=TINY_EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
    )
    model: Any = LlamaForCausalLM(config)
    model = model.float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        for p in model.parameters():
            q = p.to(torch.bfloat16).float()
            q[q.abs() < 2.0**-14] = 0.0
            p.copy_(q)
    model.save_pretrained(out, safe_serialization=True)
    write_byte_tokenizer(out)
    return out


def write_byte_tokenizer(path: str | Path) -> Path:
    """Write the tiny checkpoints' byte-level tokenizer (256 byte tokens and `</s>` =
    `TINY_EOS_ID`) and a greedy generation config ending at `</s>` to `path`: any text
    round-trips, whatever the model's vocabulary (ids above 256 decode to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(path)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_vocab = {ch: i for i, ch in enumerate(alphabet)}
    byte_vocab["</s>"] = TINY_EOS_ID
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast_cls: Any = PreTrainedTokenizerFast
    fast = fast_cls(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(out)
    gen = {"eos_token_id": TINY_EOS_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def rtn_checkpoint(src: str | Path, dst: str | Path, *, bits: int, group_size: int = 128) -> Path:
    """A copy of the checkpoint in `src` whose body's linear weights are round-to-nearest
    quantised (symmetric, `bits` bits, one scale per `group_size` inputs of a row) and stored
    dequantised in float32 at `dst`: what a provider serving an RTN-quantised model computes.
    Embeddings, norms and the lm_head stay as they are (as weight-only quantisers leave them).
    The simulated quantised provider of `benchmarks/verify_scale.py` and the verification tests."""
    import torch

    def quantise(w: torch.Tensor) -> torch.Tensor:
        rows, cols = w.shape
        pad = -cols % group_size
        x = torch.nn.functional.pad(w.float(), (0, pad)).reshape(rows, -1, group_size)
        top = 2 ** (bits - 1) - 1
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / top
        q = torch.clamp(torch.round(x / scale), -top - 1, top) * scale
        out: torch.Tensor = q.reshape(rows, -1)[:, :cols].to(w.dtype)
        return out

    return _rewritten(src, dst, lambda name, w: quantise(w) if _is_body_linear(name, w) else w)


def variant_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    noise: float = 0.0,
    seed: int = 0,
    config: dict[str, Any] | None = None,
) -> Path:
    """A copy of the checkpoint in `src` at `dst`, with gaussian noise of `noise` times each
    body linear weight's standard deviation added (a swapped checkpoint of the same
    architecture, as a fine-tune of it is) and `config` merged into its config.json (a planted
    bug, such as another RoPE base)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def perturb(name: str, w: torch.Tensor) -> torch.Tensor:
        if noise == 0.0 or not _is_body_linear(name, w):
            return w
        w32 = w.float()
        return (w32 + noise * w32.std() * torch.randn(w32.shape, generator=gen)).to(w.dtype)

    out = _rewritten(src, dst, perturb)
    if config:
        path = out / "config.json"
        merged = {**json.loads(path.read_text(encoding="utf-8")), **config}
        path.write_text(json.dumps(merged, indent=2), encoding="utf-8")
    return out


def _is_body_linear(name: str, w: Any) -> bool:
    return bool(w.ndim == 2 and "embed" not in name and "lm_head" not in name)


def _rewritten(src: str | Path, dst: str | Path, change: Any) -> Path:
    """`src` copied to `dst` with every safetensors tensor passed through `change(name, w)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, out = Path(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    for f in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(f))
        save_file({k: change(k, v).contiguous() for k, v in tensors.items()}, str(out / f.name))
    return out


def e4m3_rounded(t: Any) -> Any:
    """`t` rounded to float8_e4m3fn (scale 1, saturating at +-`E4M3_MAX`) and back to its
    dtype: what a KV cache stored in FP8 without calibrated scales hands attention."""
    import torch

    return t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(t.dtype)


def _sdpa_fp8_kv(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> Any:
    """transformers' SDPA attention reading keys and values rounded to e4m3 (looked up at each
    call, so a test can watch what it is given)."""
    from transformers.integrations import sdpa_attention

    return sdpa_attention.sdpa_attention_forward(
        module, query, e4m3_rounded(key), e4m3_rounded(value), attention_mask, **kwargs
    )


def register_fp8_kv_attention() -> str:
    """Register the FP8 KV-cache attention with transformers' `AttentionInterface` (idempotent)
    and return its name, `FP8_KV_ATTENTION`."""
    from transformers import AttentionInterface

    AttentionInterface.register(FP8_KV_ATTENTION, _sdpa_fp8_kv)
    return FP8_KV_ATTENTION


@contextmanager
def fp8_kv_cache(model: Any) -> Iterator[Any]:
    """Within the block, `model` (a loaded transformers causal LM) is a provider with an FP8
    (e4m3) KV cache: its attention is SDPA on keys and values rounded to float8_e4m3fn with
    scale 1, vLLM's `kv_cache_dtype="fp8"` without calibrated scales; its attention
    implementation is restored after. Rounding the whole cache at each read equals storing each
    entry rounded once (the rounding is elementwise and idempotent), and the current token's key
    and value are rounded too, as a cache written before attention reads it. The simulated
    provider of `benchmarks/verify.py` and `benchmarks/verify_scale.py`."""
    before = str(model.config._attn_implementation)
    model.set_attn_implementation(register_fp8_kv_attention())
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
