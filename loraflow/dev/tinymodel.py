"""The tiny checkpoints and tokenizer loraflow creates for itself, one per model family.

Nothing can be downloaded from a model hub where loraflow runs its demo and tests, so the project
makes its own Hugging Face checkpoint: a randomly initialised few-layer model of a family's real HF
architecture (the same layer layout, RoPE and quirks as the MaxText model it is converted with,
tiny dimensions) and a byte-level BPE tokenizer trained on the task's own text, with a chat
template. Deterministic for a given seed.

    python -m loraflow.dev.tinymodel --out DIR [--family llama] [--corpus FILE ...] [--seed 0]

A family's tiny model is one :class:`Tiny` entry of :data:`FAMILIES`: the MaxText model it is
converted with, its dimensions, its config.json keys, any per-layer tensor beyond the shared
decoder's (attention q/k/v/o, MLP gate/up/down, two norms) and its tokenizer's special tokens and
chat template (:class:`ChatFormat`: loraflow's own, or the family's, e.g. Gemma 3's turn tokens).
Adding a family adds an entry.

Needs numpy, safetensors and tokenizers (present in the trainer and serving environments).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from loraflow.models import ModelFamily, gemma3, llama, qwen3

# How a tensor is initialised: "normal" (std 0.02), "ones" (an RMSNorm scale), "zeros".
Init = str
Shapes = dict[str, tuple[Init, tuple[int, ...]]]


@dataclass(frozen=True)
class ChatFormat:
    """A tiny tokenizer's special tokens and chat template. The first three special tokens are its pad,
    BOS and EOS (ids 0, 1, 2, as config.json says); every special token encodes as one token."""

    special_tokens: tuple[str, ...]
    template: str
    # The token a chat answer ends with when it is not the EOS: generation stops at it too
    # (generation_config.json's eos_token_id lists both, as an instruct model ships them).
    end_of_turn: str | None = None
    # Words the template writes (role names) that the tokenizer learns as whole pieces, as a real one has them.
    words: tuple[str, ...] = ()

    @property
    def pad(self) -> str:
        return self.special_tokens[0]

    @property
    def bos(self) -> str:
        return self.special_tokens[1]

    @property
    def eos(self) -> str:
        return self.special_tokens[2]

    @property
    def stop_ids(self) -> int | list[int]:
        """generation_config.json's eos_token_id: the EOS, and the end-of-turn token when there is one."""
        return 2 if self.end_of_turn is None else [2, self.special_tokens.index(self.end_of_turn)]


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
# loraflow's own tiny chat format (the tiny Llama's and Qwen3's): a special token per role.
CHAT = ChatFormat(tuple(SPECIAL_TOKENS), CHAT_TEMPLATE)

# Gemma 3's instruct template as its tokenizer ships it, text only (its image branch dropped: the tiny
# tokenizer has no image tokens): roles user and model, a system turn folded into the first user turn,
# turns alternating, each between <start_of_turn>ROLE and <end_of_turn>.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
# Gemma 3's special tokens by name (<start_of_turn> and <end_of_turn> single tokens, as in Gemma's
# vocabulary); an answer ends with <end_of_turn>, which its generation_config lists beside <eos>.
GEMMA3_CHAT = ChatFormat(
    ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
    GEMMA3_TEMPLATE,
    end_of_turn="<end_of_turn>",
    words=("user", "model"),
)


@dataclass(frozen=True)
class Tiny:
    """One family's tiny model (the per-family hook: everything here that differs between families)."""

    family: ModelFamily
    maxtext_model: str  # the MaxText model it is converted and trained as (with maxtext_overrides)
    dims: Mapping[str, int]  # HF config keys: the shape keys the family's ``overrides`` know
    config: Callable[[Mapping[str, int]], dict[str, object]]  # the family's own config.json keys
    layer_tensors: Callable[[Mapping[str, int]], Shapes] = lambda dims: {}  # beyond the shared decoder layer's
    tied_embeddings: bool = False  # no lm_head.weight: the output projection is the embedding
    chat: ChatFormat = CHAT  # its tokenizer's special tokens and chat template

    @property
    def maxtext_overrides(self) -> dict[str, int]:
        """The MaxText overrides that give ``maxtext_model`` exactly these dimensions (the tiny spec's)."""
        return self.family.maxtext_overrides(self.dims)


def _llama_config(dims: Mapping[str, int]) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
    }


def _qwen3_config(dims: Mapping[str, int]) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": dims["num_hidden_layers"],
    }


def _qwen3_layer(dims: Mapping[str, int]) -> Shapes:
    """Qwen3's q/k norms: an RMSNorm scale over head_dim, for queries and keys."""
    return {f"self_attn.{n}_norm.weight": ("ones", (dims["head_dim"],)) for n in ("q", "k")}


def _gemma3_config(dims: Mapping[str, int]) -> dict[str, object]:
    """Gemma 3 text (gemma3-4b's RoPE, activation and query scalar): 5 sliding-window layers, then a global one."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "query_pre_attn_scalar": dims["head_dim"],  # gemma3-4b's: queries scaled by head_dim ** -0.5
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(dims["num_hidden_layers"])
        ],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
    }


def _gemma3_layer(dims: Mapping[str, int]) -> Shapes:
    """Gemma 3's q/k norms and its norms around the MLP; every norm weight random (Gemma scales by 1 + w,
    so a conversion that forgot the offset would show)."""
    d, hd = dims["hidden_size"], dims["head_dim"]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    return {
        **{f"{n}.weight": ("normal", (d,)) for n in norms},
        **{f"self_attn.{n}_norm.weight": ("normal", (hd,)) for n in ("q", "k")},
    }


# Same dimensions for every family's tiny model unless its entry says otherwise.
TINY_DIMS = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 512,
}

FAMILIES: dict[str, Tiny] = {
    # Same architecture and RoPE scaling as MaxText's llama3.1-8b, tiny dimensions.
    "llama": Tiny(llama.FAMILY, "llama3.1-8b", TINY_DIMS, _llama_config),
    # Qwen3-0.6B's architecture (q/k norms, tied embeddings, no attention bias), tiny dimensions.
    "qwen3": Tiny(qwen3.FAMILY, "qwen3-0.6b", TINY_DIMS, _qwen3_config, _qwen3_layer, tied_embeddings=True),
    # Gemma 3's text architecture as MaxText's gemma3-4b has it (tied embeddings, q/k norms, four norms a
    # layer); 7 layers: one scanned block of 6 (its 6th global) and a remainder layer; a 16-token window,
    # so the local layers' window cuts into the tiny task's 64-token rows; Gemma 3's turn tokens and template.
    "gemma3": Tiny(
        gemma3.FAMILY,
        "gemma3-4b",
        {**TINY_DIMS, "num_hidden_layers": 7, "sliding_window": 16},
        _gemma3_config,
        _gemma3_layer,
        tied_embeddings=True,
        chat=GEMMA3_CHAT,
    ),
}

# The tiny Llama (the default model of the demo, the tiny specs and most tests).
DIMS = dict(FAMILIES["llama"].dims)
MAXTEXT_MODEL = FAMILIES["llama"].maxtext_model
MAXTEXT_OVERRIDES = FAMILIES["llama"].maxtext_overrides


def tiny(family: str) -> Tiny:
    """The tiny-model entry of ``family`` (a family name, e.g. ``llama``)."""
    if family not in FAMILIES:
        raise ValueError(f"no tiny model for family {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def hf_config(dims: Mapping[str, int] = DIMS, dtype: str = "float32", family: str = "llama") -> dict[str, object]:
    """config.json of ``family``'s model with HF dimensions ``dims``."""
    entry = tiny(family)
    return {
        **entry.config(dims),
        **dims,
        "tie_word_embeddings": entry.tied_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": dtype,
    }


def weight_shapes(dims: Mapping[str, int], family: str = "llama") -> Shapes:
    """Every tensor of ``family``'s checkpoint: HF name -> (init, shape)."""
    entry = tiny(family)
    d, f, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    hd, nq, nkv = dims["head_dim"], dims["num_attention_heads"], dims["num_key_value_heads"]
    shapes: Shapes = {"model.embed_tokens.weight": ("normal", (v, d)), "model.norm.weight": ("ones", (d,))}
    if not entry.tied_embeddings:
        shapes["lm_head.weight"] = ("normal", (v, d))
    layer: Shapes = {
        "input_layernorm.weight": ("ones", (d,)),
        "post_attention_layernorm.weight": ("ones", (d,)),
        "self_attn.q_proj.weight": ("normal", (nq * hd, d)),
        "self_attn.k_proj.weight": ("normal", (nkv * hd, d)),
        "self_attn.v_proj.weight": ("normal", (nkv * hd, d)),
        "self_attn.o_proj.weight": ("normal", (d, nq * hd)),
        "mlp.gate_proj.weight": ("normal", (f, d)),
        "mlp.up_proj.weight": ("normal", (f, d)),
        "mlp.down_proj.weight": ("normal", (d, f)),
        **entry.layer_tensors(dims),
    }
    for i in range(dims["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": spec for name, spec in layer.items()}
    return shapes


def _weights(seed: int, dims: Mapping[str, int], dtype: str = "float32", family: str = "llama") -> dict[str, object]:
    """Random weights: float32 normal (std 0.02); or bfloat16 drawn as bit patterns, random sign and
    mantissa at one binade (|w| in [2**-7, 2**-6), std ~0.011), made at memory speed for the benchmarks'
    multi-billion-parameter models (a normal draw of 3 B values takes minutes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        import ml_dtypes

        stored = np.dtype(ml_dtypes.bfloat16)
    elif dtype == "float32":
        stored = np.dtype(np.float32)
    else:
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype!r}")

    def make(init: Init, shape: tuple[int, ...]) -> object:
        if init == "ones":
            return np.ones(shape, stored)
        if init == "zeros":
            return np.zeros(shape, stored)
        if dtype == "float32":
            return (rng.standard_normal(shape) * 0.02).astype(np.float32)
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        return ((bits & 0x807F) | 0x3C00).view(stored)  # sign and mantissa random, exponent 2**-7

    return {name: make(init, shape) for name, (init, shape) in weight_shapes(dims, family).items()}


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


def _tokenizer(corpus: list[str], vocab_size: int, numbers: str = "digits", chat: ChatFormat = CHAT) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Numbers first (see NUMBERS), then GPT-2 style byte-level pieces: any text encodes, spaces round-trip.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [_number_splitter(numbers), pre_tokenizers.ByteLevel(add_prefix_space=False)]  # type: ignore[list-item]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(chat.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus or ["hello world"]
    # The template's words as often as a chat-rendered corpus has them: once a line each.
    tok.train_from_iterator(lines + [word for _ in lines for word in chat.words], trainer=trainer)
    return tok


def create(
    out: Path,
    corpus_files: Iterable[Path] = (),
    seed: int = 0,
    dims: Mapping[str, int] | None = None,
    numbers: str = "digits",
    dtype: str = "float32",
    family: str = "llama",
) -> Path:
    """Write a complete HF checkpoint directory (config, weights, tokenizer) of ``family`` into ``out``;
    ``dims`` (the keys of ``DIMS``; default the family's tiny ones) makes a larger model of the same
    architecture (the benchmarks do); ``numbers`` is how the tokenizer splits numbers (``NUMBERS``);
    ``dtype`` the weights' (see ``_weights``)."""
    from safetensors.numpy import save_file

    entry = tiny(family)
    dims = dict(entry.dims if dims is None else dims)
    chat = entry.chat

    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(list(_corpus_lines(corpus_files)), dims["vocab_size"], numbers, chat)
    tok.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": chat.bos,
                "eos_token": chat.eos,
                "pad_token": chat.pad,
                "unk_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 2048,
                "chat_template": chat.template,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": chat.bos, "eos_token": chat.eos, "pad_token": chat.pad}, indent=2)
    )
    (out / "config.json").write_text(json.dumps(hf_config(dims, dtype, family), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": chat.stop_ids, "pad_token_id": 0, "do_sample": False}, indent=2)
    )
    save_file(_weights(seed, dims, dtype, family), str(out / "model.safetensors"), metadata={"format": "pt"})  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loraflow.dev.tinymodel", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write the HF checkpoint into")
    p.add_argument("--corpus", type=Path, action="append", default=[], help="JSONL whose text trains the tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama", help="the model family's architecture")
    p.add_argument(
        "--numbers",
        choices=NUMBERS,
        default="digits",
        help="how the tokenizer splits numbers: one digit per piece, or groups of up to 3 digits like Llama 3's",
    )
    args = p.parse_args(argv)
    create(args.out, args.corpus, args.seed, numbers=args.numbers, family=args.family)
    print(f"tiny {args.family} checkpoint written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
