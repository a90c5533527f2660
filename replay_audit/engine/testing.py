"""A tiny random Llama checkpoint for fast tests (imports torch and transformers).

Its weights are exactly representable in BF16 and in FP16 (rounded to BF16, magnitudes below
FP16's smallest normal flushed to zero), so an engine in either format holds the very same lm_head
values: what differs between the arms is arithmetic, not storage. Its tokenizer is byte-level
(256 byte tokens and `</s>` = 256), so any text round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Token id of `</s>` in the tiny checkpoint's tokenizer.
TINY_EOS_ID = 256


def make_tiny_checkpoint(
    path: str | Path,
    *,
    vocab_size: int = 272,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    head_scale: float = 8.0,
) -> Path:
    """Write a random `LlamaForCausalLM` (float32 safetensors) and a byte-level tokenizer to
    `path`. `head_scale` multiplies the lm_head weights so the next-token distributions are
    peaked like a trained model's, with occasional close calls."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
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
