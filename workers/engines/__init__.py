"""Engines: the model behind a worker (``sim`` built in, ``torch`` for real models, or plugins)."""

from workers.engines.base import Engine, EngineOptions, KVChecker, ModelInfo, SeqInput, SeqOutput
from workers.plugins import load_plugin

__all__ = ["Engine", "EngineOptions", "KVChecker", "ModelInfo", "SeqInput", "SeqOutput", "create_engine"]


def create_engine(name: str, options: EngineOptions) -> Engine:
    """Build the engine registered as ``name`` in ``pd_gateway.engines`` (or a module:attr path)."""
    cls = load_plugin("pd_gateway.engines", name, Engine)
    engine: Engine = cls(options)
    return engine
