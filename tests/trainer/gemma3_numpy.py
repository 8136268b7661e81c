"""A small numpy Gemma 3 text forward (HF layout, ``Gemma3ForCausalLM``) for checking tuned weights
without torch, written from Gemma 3's definition rather than from MaxText or transformers:

* the embedding multiplied by ``sqrt(hidden_size)``, the output projection the embedding (tied);
* every RMSNorm scales by ``1 + w``; four per layer (before and after attention, before and after
  the MLP), and q/k norms over each head before RoPE;
* queries scaled by ``query_pre_attn_scalar ** -0.5``;
* ``layer_types``: a sliding-window layer sees its last ``sliding_window`` positions (itself
  included) with the local RoPE, a full-attention layer every earlier position with the global one
  (``rope_parameters``, linear scaling divides the frequencies);
* the MLP ``gelu_tanh(x Wg) * (x Wu)``.

On the tiny model it agrees with transformers' ``Gemma3ForCausalLM`` to ~1e-6 (checked once by hand
in the serving environment); ``forward`` has the signature of ``llama_numpy.forward``.
"""

from __future__ import annotations

import math

import numpy as np


def _rope_tables(params: dict, hd: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (params["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if params.get("rope_type") == "linear":
        inv = inv / params["factor"]
    ang = np.arange(length)[:, None] * inv[None, :]
    return np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))


def forward(cfg: dict, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits (T, vocab) for one sequence."""
    T = len(ids)
    d, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    rope = {kind: _rope_tables(p, hd, T) for kind, p in cfg["rope_parameters"].items()}
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    masks = {
        "full_attention": np.where(j <= i, 0.0, -np.inf),
        "sliding_attention": np.where((j <= i) & (i - j < cfg["sliding_window"]), 0.0, -np.inf),
    }

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + g)

    def rotate(x: np.ndarray, kind: str) -> np.ndarray:  # (h, T, hd), HF rotate_half layout
        cos, sin = rope[kind]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    def gelu_tanh(x: np.ndarray) -> np.ndarray:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    embedding = w["model.embed_tokens.weight"]
    x = embedding[ids] * np.float32(math.sqrt(d))
    for layer, kind in enumerate(cfg["layer_types"][: cfg["num_hidden_layers"]]):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        q = rotate(rms(q, w[p + "self_attn.q_norm.weight"]), kind)
        k = rotate(rms(k, w[p + "self_attn.k_norm.weight"]), kind)
        k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
        s = q @ k.transpose(0, 2, 1) * cfg["query_pre_attn_scalar"] ** -0.5 + masks[kind]
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = x + rms(o, w[p + "post_attention_layernorm.weight"])
        h = rms(x, w[p + "pre_feedforward_layernorm.weight"])
        m = gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + rms(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_feedforward_layernorm.weight"])
    return rms(x, w["model.norm.weight"]) @ embedding.T
