"""The ``torch`` engine: a Llama-family transformer (Llama, SmolLM2, Qwen2, Qwen3) over the paged KV pool."""

from workers.engines.llama.attention import AttentionBackend, StepLayout, make_backend
from workers.engines.llama.config import ModelConfig, ModelConfigError, RopeConfig, load_config, parse_config
from workers.engines.llama.engine import TorchEngine
from workers.engines.llama.gguf_convert import convert_gguf, default_model_dir
from workers.engines.llama.model import LlamaModel
from workers.engines.llama.sampling import derive_seed

__all__ = [
    "AttentionBackend",
    "LlamaModel",
    "ModelConfig",
    "ModelConfigError",
    "RopeConfig",
    "StepLayout",
    "TorchEngine",
    "convert_gguf",
    "default_model_dir",
    "derive_seed",
    "load_config",
    "make_backend",
    "parse_config",
]
