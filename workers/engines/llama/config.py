"""Model configuration for the Llama family, read from an HF-style ``config.json`` by our own code.

We read the JSON ourselves instead of going through transformers: the runtime has no transformers,
and transformers 5 moved ``rope_theta`` into ``rope_parameters`` (older files keep it top-level), so
both layouts are accepted here. Every flag that changes the math (q/k/v bias, q/k norm, tied head,
head_dim) is explicit in ``ModelConfig``; nothing is inferred from which weights happen to exist.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """A model directory that cannot be served: missing files, unsupported model, bad field."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_context: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def load_config(model_dir: str) -> ModelConfig:
    """Read and validate ``<model_dir>/config.json`` (+ ``generation_config.json`` for EOS ids)."""
    if not os.path.isdir(model_dir):
        raise ModelConfigError(f"model directory {model_dir!r} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelConfigError(f"{model_dir!r} has no config.json")
    raw = _read_json(path)
    generation = os.path.join(model_dir, "generation_config.json")
    gen_raw = _read_json(generation) if os.path.isfile(generation) else {}
    cfg = parse_config(raw, gen_raw, source=path)
    own = _tokenizer_eos_id(model_dir)
    if own is not None and own not in cfg.eos_token_ids and 0 <= own < cfg.vocab_size:
        cfg = dataclasses.replace(cfg, eos_token_ids=(*cfg.eos_token_ids, own))
    return cfg


def _tokenizer_eos_id(model_dir: str) -> int | None:
    """The tokenizer's own ``eos_token`` (``tokenizer_config.json``, or a legacy one's ``special_tokens_map.json``),
    which vLLM and SGLang stop at as well as the configs' ids: a fine-tune that changed only it (to its chat
    template's end-of-turn) stops there."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    vocab = os.path.join(model_dir, "tokenizer.json")
    if not (os.path.isfile(path) and os.path.isfile(vocab)):
        return None
    config = _read_json(path)
    eos = config.get("eos_token")
    legacy_map = os.path.join(model_dir, "special_tokens_map.json")
    if "added_tokens_decoder" not in config and os.path.isfile(legacy_map):
        # (a config saved before transformers 4.34: its special tokens are the map's, as transformers, and the
        # gateway's tokenizer, read them)
        eos = _read_json(legacy_map).get("eos_token") or eos
    if isinstance(eos, dict):  # (a serialized AddedToken)
        eos = eos.get("content")
    if not isinstance(eos, str) or not eos:
        return None
    from tokenizers import Tokenizer

    try:
        token_id: int | None = Tokenizer.from_file(vocab).token_to_id(eos)
    except Exception as exc:  # (tokenizers' own errors for a file it cannot read)
        raise ModelConfigError(f"cannot read {vocab}: {exc}") from exc
    return token_id


def parse_config(raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "") -> ModelConfig:
    where = f" in {source}" if source else ""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"unsupported model_type {model_type!r}{where}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"unsupported hidden_act {act!r}{where}; only 'silu' is implemented")

    hidden = _int(raw, "hidden_size", where)
    num_heads = _int(raw, "num_attention_heads", where)
    num_kv_heads = _int(raw, "num_key_value_heads", where, default=num_heads)
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}{where}"
        )
    head_dim_raw = raw.get("head_dim")
    if head_dim_raw is None:
        if hidden % num_heads:
            raise ModelConfigError(f"hidden_size={hidden} is not divisible by num_attention_heads{where}")
        head_dim = hidden // num_heads
    else:
        head_dim = _int(raw, "head_dim", where)
    if head_dim % 2:
        raise ModelConfigError(f"head_dim={head_dim} must be even for rotary embeddings{where}")

    _check_full_attention(raw, where)
    is_qwen2 = model_type == "qwen2"
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        model_type=model_type,
        vocab_size=_int(raw, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", where),
        num_layers=_int(raw, "num_hidden_layers", where),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(raw, "rms_norm_eps", where, default=1e-6),
        max_context=_int(raw, "max_position_embeddings", where, default=2048),
        rope=parse_rope(raw, where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and never an o bias; Llama/Qwen3 follow attention_bias.
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        eos_token_ids=_eos_ids(raw, generation or {}),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
    )


def parse_rope(raw: dict[str, Any], where: str = "") -> RopeConfig:
    """RoPE settings from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelConfigError(f"rope_parameters must be an object, got {params!r}{where}")
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelConfigError(f"rope_scaling must be an object or null, got {scaling!r}{where}")
    merged: dict[str, Any] = {}
    if scaling:
        merged.update(scaling)
    if params:
        merged.update(params)
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta) or theta <= 0:
        raise ModelConfigError(f"bad rope_theta {theta!r}{where}: must be a positive number")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope_type {rope_type!r}{where}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factor = merged.get("factor")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if factor is None or isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
        raise ModelConfigError(f"bad rope factor {factor!r} for rope_type {rope_type!r}{where}")
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type=rope_type, factor=float(factor))
    try:
        low = float(merged.get("low_freq_factor", 1.0))
        high = float(merged.get("high_freq_factor", 4.0))
        original = int(merged.get("original_max_position_embeddings", 8192))
    except (TypeError, ValueError) as exc:
        raise ModelConfigError(f"bad llama3 rope parameters {merged!r}{where}: {exc}") from exc
    if not 0 < low < high or original <= 0:
        raise ModelConfigError(f"bad llama3 rope parameters {merged!r}{where}: need 0 < low < high freq factor")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def _check_full_attention(raw: dict[str, Any], where: str) -> None:
    if raw.get("use_sliding_window"):
        raise ModelConfigError(f"use_sliding_window=true is not supported{where}")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ModelConfigError(f"only full_attention layers are supported, layer_types={layer_types}{where}")


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), raw.get("eos_token_id")):
        values = source if isinstance(source, list) else [source]
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and value not in ids:
                ids.append(value)
    return tuple(ids)


def _int(raw: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ModelConfigError(f"config field {key!r} is missing{where}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"config field {key!r} must be a positive integer, got {value!r}{where}")
    return value


def _float(raw: dict[str, Any], key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ModelConfigError(f"config field {key!r} must be a positive number, got {value!r}{where}")
    return float(value)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} must hold a JSON object")
    return data
