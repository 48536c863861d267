"""Tiny random Hugging Face checkpoints for tests, examples and benchmarks.

``make_random_checkpoint`` builds the model with transformers itself and saves it with
``save_pretrained``, so the files are exactly what a real checkpoint of that architecture looks
like. Every weight is random (biases and norm weights too, so that a loader which drops or swaps
one of them is caught), scaled so that next-token distributions are peaked but not one-hot.

    python -m specbatch.testing.checkpoints OUT_DIR --arch llama [--with-tokenizer]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Special tokens of the optional tokenizer, with the ids the model config uses for them.
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (UNK, BOS, EOS)
BOS_ID, EOS_ID = 1, 2

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a few tokens and verifies them in one pass.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests while others are still running.",
    "Hello world! Once upon a time there was a tiny language model.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10: numbers are tokens too.",
]

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _config(arch: str, **kwargs: Any) -> Any:
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
        "mistral": (transformers.MistralConfig, "MistralForCausalLM"),
        "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM"),
        "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM"),
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    config_cls, arch_name = classes[arch]
    return config_cls(architectures=[arch_name], **kwargs)


def _randomise(model: torch.nn.Module, hidden_size: int) -> None:
    """Random weights everywhere, scaled so the residual stream stays O(1) and logits are peaked."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p) * (2.0 / math.sqrt(hidden_size)))
            else:  # projections: fan-in scaling
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))


def make_random_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    rope_scaling: dict[str, Any] | None = None,
    with_tokenizer: bool = False,
    **extra_config: Any,
) -> Path:
    """Write a random ``arch`` checkpoint (config.json + model.safetensors) to ``out_dir``.

    ``rope_scaling`` is e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``; ``extra_config``
    goes to the transformers config as it is (``head_dim=32``, ``attention_bias=True``, ...).
    Qwen3's ``head_dim`` defaults to ``hidden_size // num_heads`` here (transformers says 128).
    The same arguments and seed always give the same weights.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
        "head_dim": hidden_size // num_heads,
    }
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
    kwargs.update(extra_config)
    config = _config(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, hidden_size)
    if tie_word_embeddings:
        model.tie_weights()
    model = model.to(dtype)
    model.config.dtype = dtype
    out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if with_tokenizer:
        save_tokenizer(out, vocab_size)
    return out


def save_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """A small byte-level BPE tokenizer (ids < ``vocab_size``) trained on a few sentences.

    The base alphabet is printable ASCII plus newline and tab (other characters map to
    ``<unk>``); ids 0, 1, 2 are ``<unk>``, ``<s>`` (bos) and ``</s>`` (eos).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = [c for c in pre_tokenizers.ByteLevel.alphabet() if c.isprintable()]
    ascii_chars = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    # The byte-level alphabet spells space, newline and tab as other characters.
    mapped = sorted({byte_level.pre_tokenize_str(c)[0][0] for c in ascii_chars} & set(alphabet))
    if vocab_size < len(SPECIAL_TOKENS) + len(mapped):
        raise ValueError(
            f"vocab_size={vocab_size} is too small for the tokenizer; "
            f"need at least {len(SPECIAL_TOKENS) + len(mapped)}"
        )
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=mapped,
        limit_alphabet=len(mapped),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK, bos_token=BOS, eos_token=EOS
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random Hugging Face checkpoint.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--max-position-embeddings", type=int, default=512)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--with-tokenizer", action="store_true")
    a = parser.parse_args(argv)
    path = make_random_checkpoint(
        a.out_dir,
        a.arch,
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        intermediate_size=a.intermediate_size,
        max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings,
        seed=a.seed,
        dtype=getattr(torch, a.dtype),
        with_tokenizer=a.with_tokenizer,
    )
    print(path)


if __name__ == "__main__":
    main()
