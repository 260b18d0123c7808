"""The Llama-family transformer (Llama, SmolLM2, Qwen2, Qwen3) as plain tensors and functions.

Lifecycle:
1. ``LlamaModel.load(model_dir, cfg, dtype, device)`` reads the checkpoint once (q/k/v and
   gate/up projections fused into one matrix each) and is read-only afterwards.
2. Per step the engine calls ``hidden(tokens, positions, attention)`` on the flattened batch after
   ``attention.plan(...)``; it returns final-normed hidden states ``[T, hidden]``.
3. ``logits(hidden_rows)`` projects only the rows the engine needs through the LM head (float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engines.llama.attention import AttentionBackend
from workers.engines.llama.config import ModelConfig
from workers.engines.llama.rope import apply_rope, inverse_frequencies, rope_tables
from workers.engines.llama.weights import Checkpoint


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled by ``weight`` in the input dtype (as HF Llama)."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> None:
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim).to(embed.device)
        self._q_size = cfg.num_heads * cfg.head_dim
        self._kv_size = cfg.num_kv_heads * cfg.head_dim

    @classmethod
    def load(cls, model_dir: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaModel:
        ckpt = Checkpoint(model_dir, dtype, device)
        try:
            return cls._from_checkpoint(ckpt, cfg)
        finally:
            ckpt.close()

    @classmethod
    def _from_checkpoint(cls, ckpt: Checkpoint, cfg: ModelConfig) -> LlamaModel:
        h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
        embed = ckpt.get("model.embed_tokens.weight", (cfg.vocab_size, h))
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."

            def bias(name: str, size: int, present: bool) -> torch.Tensor | None:
                return ckpt.get(name, (size,)) if present else None

            qkv_bias = None
            if cfg.qkv_bias:
                qkv_bias = torch.cat(
                    [
                        ckpt.get(attn + "q_proj.bias", (q_out,)),
                        ckpt.get(attn + "k_proj.bias", (kv_out,)),
                        ckpt.get(attn + "v_proj.bias", (kv_out,)),
                    ]
                )
            gate_up_bias = None
            if cfg.mlp_bias:
                gate_up_bias = torch.cat(
                    [ckpt.get(mlp + "gate_proj.bias", (inter,)), ckpt.get(mlp + "up_proj.bias", (inter,))]
                )
            layers.append(
                LayerWeights(
                    input_norm=ckpt.get(p + "input_layernorm.weight", (h,)),
                    post_norm=ckpt.get(p + "post_attention_layernorm.weight", (h,)),
                    qkv=torch.cat(
                        [
                            ckpt.get(attn + "q_proj.weight", (q_out, h)),
                            ckpt.get(attn + "k_proj.weight", (kv_out, h)),
                            ckpt.get(attn + "v_proj.weight", (kv_out, h)),
                        ]
                    ),
                    qkv_bias=qkv_bias,
                    o=ckpt.get(attn + "o_proj.weight", (h, q_out)),
                    o_bias=bias(attn + "o_proj.bias", h, cfg.o_bias),
                    gate_up=torch.cat(
                        [ckpt.get(mlp + "gate_proj.weight", (inter, h)), ckpt.get(mlp + "up_proj.weight", (inter, h))]
                    ),
                    gate_up_bias=gate_up_bias,
                    down=ckpt.get(mlp + "down_proj.weight", (h, inter)),
                    down_bias=bias(mlp + "down_proj.bias", h, cfg.mlp_bias),
                    q_norm=ckpt.get(attn + "q_norm.weight", (d,)) if cfg.qk_norm else None,
                    k_norm=ckpt.get(attn + "k_norm.weight", (d,)) if cfg.qk_norm else None,
                )
            )
        norm = ckpt.get("model.norm.weight", (h,))
        if "lm_head.weight" in ckpt:
            lm_head = ckpt.get("lm_head.weight", (cfg.vocab_size, h))
        elif cfg.tie_word_embeddings:
            lm_head = embed
        else:
            ckpt.get("lm_head.weight", (cfg.vocab_size, h))  # raises: names the missing tensor
            raise AssertionError("unreachable")
        return cls(cfg, embed, layers, norm, lm_head)

    @torch.inference_mode()
    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend) -> torch.Tensor:
        """Run every layer over the flattened batch; returns final-normed states ``[T, hidden]``."""
        cfg = self.cfg
        num_rows = tokens.shape[0]
        cos, sin = rope_tables(self.inv_freq, positions, self.dtype)
        x = F.embedding(tokens, self.embed)
        for index, w in enumerate(self.layers):
            h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(h, w.qkv, w.qkv_bias)
            q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
            q = q.reshape(num_rows, cfg.num_heads, cfg.head_dim)
            k = k.reshape(num_rows, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(num_rows, cfg.num_kv_heads, cfg.head_dim)
            if w.q_norm is not None and w.k_norm is not None:
                q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            attn = attention.run(index, q, k, v).reshape(num_rows, self._q_size)
            x = x + F.linear(attn, w.o, w.o_bias)
            h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)
            gate, up = F.linear(h, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down, w.down_bias)
        return rms_norm(x, self.norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits in float32 for the given final-normed rows ``[N, hidden]``."""
        return F.linear(hidden, self.lm_head).to(torch.float32)
