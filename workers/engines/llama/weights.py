"""Reading safetensors checkpoints (one file, or shards listed in ``model.safetensors.index.json``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack

import torch
from safetensors import safe_open

from workers.engines.llama.config import ModelConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of ``model_dir``, in a stable order."""
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelConfigError(f"cannot read {index}: {exc}") from exc
        files = sorted(set(weight_map.values()))
        paths = [os.path.join(model_dir, name) for name in files]
        for path in paths:
            if not os.path.isfile(path):
                raise ModelConfigError(f"{index} names shard {os.path.basename(path)!r}, which is missing")
        return paths
    raise ModelConfigError(f"{model_dir!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


class Checkpoint:
    """Named tensors of a checkpoint, loaded on demand and converted to one dtype and device."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device) -> None:
        self._dtype = dtype
        self._device = device
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        try:
            for path in checkpoint_files(model_dir):
                handle = self._stack.enter_context(safe_open(path, framework="pt"))
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._where[name] = handle
        except ModelConfigError:
            self._stack.close()
            raise
        except Exception as exc:
            self._stack.close()
            raise ModelConfigError(f"cannot open the safetensors checkpoint in {model_dir!r}: {exc}") from exc

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise ModelConfigError(f"checkpoint has no tensor {name!r}")
        tensor: torch.Tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
        if tuple(tensor.shape) != shape:
            raise ModelConfigError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {shape}")
        return tensor.to(device=self._device, dtype=self._dtype)

    def close(self) -> None:
        self._stack.close()
