"""A small numpy Llama 3.1 / Qwen3 forward (HF layout) for checking tuned weights without torch.

Qwen3's differences are taken from the checkpoint itself: q/k norms (an RMSNorm over each head's
query and key before RoPE) when it has ``self_attn.q_norm``/``k_norm`` weights, the embedding as the
output projection when it has no ``lm_head.weight`` (tied), plain RoPE when ``rope_scaling`` is null.

Used by the trainer tests and for measuring parity accuracy: merge a PEFT adapter into the HF
weights (W[out,in] += alpha/r * B @ A) and greedy-decode with the HF chat template.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def load_hf(hf_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    weights: dict[str, np.ndarray] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        weights |= {k: v.astype(np.float32) for k, v in load_file(str(f)).items()}
    return cfg, weights


def merge_peft(weights: dict[str, np.ndarray], peft_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    acfg = json.loads((Path(peft_dir) / "adapter_config.json").read_text())
    scale = acfg["lora_alpha"] / acfg["r"]
    lora = load_file(str(Path(peft_dir) / "adapter_model.safetensors"))
    out = dict(weights)
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        target = key[len("base_model.model.") :].replace(".lora_A.weight", ".weight")
        out[target] = out[target] + scale * (b.astype(np.float32) @ a.astype(np.float32))
    return out


def _rope_inv_freq(cfg: dict) -> np.ndarray:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "llama3":
        factor, lo, hi, old = (
            rs["factor"],
            rs["low_freq_factor"],
            rs["high_freq_factor"],
            rs["original_max_position_embeddings"],
        )
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= hi_wl) & (wl <= lo_wl)
        inv = np.where(is_mid, mid, scaled)
    return inv


def forward(cfg: dict, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits (T, vocab) for one sequence."""
    if cfg.get("model_type") == "gemma3_text":  # another architecture: gemma3_numpy
        import gemma3_numpy

        return gemma3_numpy.forward(cfg, w, ids)
    T = len(ids)
    d, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // nh
    eps = cfg["rms_norm_eps"]
    inv = _rope_inv_freq(cfg)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def rope(x):  # (h, T, hd), HF rotate_half layout
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T  # tied: the embedding


def greedy(cfg: dict, w: dict[str, np.ndarray], ids: list[int], eos: int | list[int], max_new: int = 4) -> list[int]:
    """Up to ``max_new`` greedy tokens, stopping at ``eos`` (a token id, or several: an end-of-turn token too)."""
    stop = {eos} if isinstance(eos, int) else set(eos)
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(forward(cfg, w, ids + out)[-1].argmax())
        if nxt in stop:
            break
        out.append(nxt)
    return out


def parity_accuracy(hf_dir: Path, eval_file: Path, peft_dir: Path | None = None, n: int = 50) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    cfg, w = load_hf(hf_dir)
    if peft_dir is not None:
        w = merge_peft(w, peft_dir)
    rows = [json.loads(line) for line in Path(eval_file).read_text().splitlines() if line.strip()][:n]
    # Stop where vLLM and transformers' generate stop: generation_config.json's eos ids (Gemma's <end_of_turn> too).
    gen = Path(hf_dir) / "generation_config.json"
    stop = json.loads(gen.read_text()).get("eos_token_id", tok.eos_token_id) if gen.is_file() else tok.eos_token_id
    good = 0
    for row in rows:
        text = tok.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        ids = tok.encode(text, add_special_tokens=False)
        text = tok.decode(greedy(cfg, w, ids, stop), skip_special_tokens=True).strip()
        good += text == row["completion"]
    return good / len(rows)
