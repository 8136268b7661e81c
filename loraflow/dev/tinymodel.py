"""The tiny Llama-architecture checkpoint and tokenizer loraflow creates for itself.

Nothing can be downloaded from a model hub where loraflow runs its demo and tests, so the project
makes its own Hugging Face checkpoint: a randomly initialised 2-layer Llama 3.1 (same architecture
and RoPE scaling as MaxText's ``llama3.1-8b``, tiny dimensions) and a byte-level BPE tokenizer
trained on the task's own text, with a chat template. Deterministic for a given seed.

    python -m loraflow.dev.tinymodel --out DIR [--corpus FILE ...] [--seed 0]

Needs numpy, safetensors and tokenizers (present in the trainer and serving environments).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from loraflow.models import llama

# The tiny Llama's dimensions.
DIMS = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 512,
}
# The MaxText model and command-line overrides that give it exactly these dimensions (the tiny
# spec's base_model section says the same); the Llama family knows which override sets which dimension.
MAXTEXT_MODEL = "llama3.1-8b"
MAXTEXT_OVERRIDES = llama.maxtext_overrides(DIMS)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]

# Each turn renders as ROLE-TOKEN content; an assistant turn ends with <|end|> (the EOS token).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def hf_config(dims: Mapping[str, int] = DIMS, dtype: str = "float32") -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **dims,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": dtype,
    }


def _weights(seed: int, dims: Mapping[str, int], dtype: str = "float32") -> dict[str, object]:
    """Random weights: float32 normal (std 0.02); or bfloat16 drawn as bit patterns, random sign and
    mantissa at one binade (|w| in [2**-7, 2**-6), std ~0.011), made at memory speed for the benchmarks'
    multi-billion-parameter models (a normal draw of 3 B values takes minutes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    d, f, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    hd, nq, nkv = dims["head_dim"], dims["num_attention_heads"], dims["num_key_value_heads"]
    if dtype == "bfloat16":
        import ml_dtypes

        stored = np.dtype(ml_dtypes.bfloat16)
    elif dtype == "float32":
        stored = np.dtype(np.float32)
    else:
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype!r}")

    def normal(*shape: int) -> object:
        if dtype == "float32":
            return (rng.standard_normal(shape) * 0.02).astype(np.float32)
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        return ((bits & 0x807F) | 0x3C00).view(stored)  # sign and mantissa random, exponent 2**-7

    def ones(n: int) -> object:
        return np.ones(n, stored)

    tensors: dict[str, object] = {
        "model.embed_tokens.weight": normal(v, d),
        "model.norm.weight": ones(d),
        "lm_head.weight": normal(v, d),
    }
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones(d),
            p + "post_attention_layernorm.weight": ones(d),
            p + "self_attn.q_proj.weight": normal(nq * hd, d),
            p + "self_attn.k_proj.weight": normal(nkv * hd, d),
            p + "self_attn.v_proj.weight": normal(nkv * hd, d),
            p + "self_attn.o_proj.weight": normal(d, nq * hd),
            p + "mlp.gate_proj.weight": normal(f, d),
            p + "mlp.up_proj.weight": normal(f, d),
            p + "mlp.down_proj.weight": normal(d, f),
        }
    return tensors


def _corpus_lines(paths: Iterable[Path]) -> Iterator[str]:
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" in row:
                yield from (m["content"] for m in row["messages"])
            else:
                yield row.get("prompt", "")
                yield row.get("completion", "")


# How the tokenizer splits numbers before byte-level BPE: "digits" one by one (the parity task
# reads the last digit), or "groups" of up to three digits as Llama 3's tokenizer does (BPE then
# learns a frequent small number as one token: the arithmetic task's 0-18 are single tokens).
NUMBERS = ("digits", "groups")


def _number_splitter(numbers: str) -> object:
    from tokenizers import Regex, pre_tokenizers

    if numbers == "digits":
        return pre_tokenizers.Digits(individual_digits=True)
    if numbers == "groups":
        return pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated")
    raise ValueError(f"numbers must be one of {', '.join(NUMBERS)}, not {numbers!r}")


def _tokenizer(corpus: list[str], vocab_size: int, numbers: str = "digits") -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Numbers first (see NUMBERS), then GPT-2 style byte-level pieces: any text encodes, spaces round-trip.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [_number_splitter(numbers), pre_tokenizers.ByteLevel(add_prefix_space=False)]  # type: ignore[list-item]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or ["hello world"], trainer=trainer)
    return tok


def create(
    out: Path,
    corpus_files: Iterable[Path] = (),
    seed: int = 0,
    dims: Mapping[str, int] = DIMS,
    numbers: str = "digits",
    dtype: str = "float32",
) -> Path:
    """Write a complete HF checkpoint directory (config, weights, tokenizer) into ``out``; ``dims``
    (the keys of ``DIMS``) makes a larger model of the same architecture (the benchmarks do);
    ``numbers`` is how the tokenizer splits numbers (``NUMBERS``); ``dtype`` the weights' (see ``_weights``)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(list(_corpus_lines(corpus_files)), dims["vocab_size"], numbers)
    tok.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|end|>",
                "pad_token": "<|pad|>",
                "unk_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 2048,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|end|>", "pad_token": "<|pad|>"}, indent=2)
    )
    (out / "config.json").write_text(json.dumps(hf_config(dims, dtype), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, indent=2)
    )
    save_file(_weights(seed, dims, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loraflow.dev.tinymodel", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write the HF checkpoint into")
    p.add_argument("--corpus", type=Path, action="append", default=[], help="JSONL whose text trains the tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--numbers",
        choices=NUMBERS,
        default="digits",
        help="how the tokenizer splits numbers: one digit per piece, or groups of up to 3 digits like Llama 3's",
    )
    args = p.parse_args(argv)
    create(args.out, args.corpus, args.seed, numbers=args.numbers)
    print(f"tiny Llama checkpoint written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
