"""Factories for the torch engine tests: tiny random HF models (built offline, cached per session)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from workers.engines.base import EngineOptions  # noqa: E402
from workers.engines.llama import TorchEngine  # noqa: E402
from workers.kv_pool import KVPool  # noqa: E402

TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
)
# Qwen3 gets an explicit head_dim that differs from hidden_size / heads (64 / 4 = 16).
MODEL_VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
}


@dataclass
class TinyModel:
    name: str
    path: str
    reference: Any  # transformers model with generation_config.eos_token_id = None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """``tiny_model(variant)``: a saved random model of ``MODEL_VARIANTS[variant]`` and its reference."""
    transformers = pytest.importorskip("transformers")
    cache: dict[str, TinyModel] = {}

    def build(variant: str) -> TinyModel:
        if variant not in cache:
            spec = dict(MODEL_VARIANTS[variant])
            model_type = spec.pop("model_type")
            cfg = transformers.AutoConfig.for_model(model_type, **TINY_SHAPE, **spec)
            torch.manual_seed(1234)
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
            path = tmp_path_factory.mktemp(f"tiny-{variant}")
            model.save_pretrained(path)
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            cache[variant] = TinyModel(variant, str(path), model)
        return cache[variant]

    return build


@dataclass
class EngineUnderTest:
    engine: TorchEngine
    pool: KVPool


@pytest.fixture
def make_engine() -> Iterator[Callable[..., EngineUnderTest]]:
    """``make_engine(model_dir, num_pages=..., page_size=..., **options)``: a bound engine + its pool."""
    made: list[TorchEngine] = []

    def build(model_dir: str, *, num_pages: int = 128, page_size: int = 4, **options: Any) -> EngineUnderTest:
        engine = TorchEngine(EngineOptions(model=model_dir, **options))
        info = engine.info
        pool = KVPool(
            num_layers=info.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            dtype=info.kv_dtype,
        )
        engine.bind(pool)
        made.append(engine)
        return EngineUnderTest(engine, pool)

    yield build
    for engine in made:
        engine.close()


CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 😀 👍🏽 🎉 and flags 🇫🇷 with text around them.",
    "Numbers like 12345 and 3.14159 appear in text.",
] * 20


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE (vocab 400) trained on a small corpus, with ChatML specials and template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer=trainer)
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return str(path)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The converted SmolLM2-135M-Instruct directory (converted once per machine, then cached)."""
    pytest.importorskip("gguf")
    from workers.engines.llama.gguf_convert import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tiny_model: Callable[[str], TinyModel], tiny_tokenizer_dir: str,
                              tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random llama with the tiny BPE tokenizer beside it (ids < 400 of its 512): a model directory a
    grammar can be compiled for (read only: a test that changes it copies it)."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-llama-tokenizer")
    shutil.copytree(tiny_model("llama").path, path, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_tokenizer_dir}/{name}", path / name)
    return str(path)
