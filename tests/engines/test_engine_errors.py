"""Bad model directories, bad pools and bad batches: clear errors that name the problem."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_harness import Request, reference_greedy, run_requests

from workers.engines.base import EngineOptions, SeqInput
from workers.engines.llama import ModelConfigError, TorchEngine, load_config
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory_and_config(tmp_path) -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        TorchEngine(EngineOptions(model=str(tmp_path / "nope")))
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        TorchEngine(EngineOptions(model=str(tmp_path)))
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ModelConfigError, match=r"cannot read .*config\.json"):
        TorchEngine(EngineOptions(model=str(tmp_path)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"model_type": None}, "unsupported model_type None"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
            "unsupported rope_type 'yarn'",
        ),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "bad rope_theta -1"),
        ({"rope_parameters": "fast"}, "rope_parameters must be an object"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}, "rope_scaling": None}, "bad rope factor"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"hidden_size": None}, "'hidden_size' is missing"),
        ({"num_hidden_layers": "2"}, "'num_hidden_layers' must be a positive integer"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_bad_config_fields(tmp_path, tiny_model, changes, message) -> None:
    model = _copy(tiny_model("llama").path, tmp_path / "m")
    _edit_config(model, **changes)
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TorchEngine(EngineOptions(model=str(model)))


def test_both_rope_layouts_are_read(tmp_path, tiny_model, make_engine) -> None:
    """Older files keep rope_theta at the top level; transformers 5 writes rope_parameters."""
    src = tiny_model("llama")
    model = _copy(src.path, tmp_path / "old-layout")
    _edit_config(model, rope_parameters=None, rope_theta=10000.0)
    assert load_config(str(model)).rope == load_config(src.path).rope
    changed = _copy(src.path, tmp_path / "other-theta")
    _edit_config(changed, rope_parameters=None, rope_theta=500.0)
    assert load_config(str(changed)).rope.theta == 500.0
    eut = make_engine(str(model))
    req = Request(rid=1, prompt=[4, 5, 6, 7, 8], max_new_tokens=3)
    run_requests(eut.engine, eut.pool, [req])
    assert req.outputs == reference_greedy(src.reference, req.prompt, 3)[0]


def test_missing_or_wrong_weights(tmp_path, tiny_model) -> None:
    from safetensors.torch import load_file, save_file

    model = _copy(tiny_model("llama").path, tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        TorchEngine(EngineOptions(model=str(model)))
    without = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(without, model / "model.safetensors")
    with pytest.raises(ModelConfigError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        TorchEngine(EngineOptions(model=str(model)))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, model / "model.safetensors")
    with pytest.raises(ModelConfigError, match="lm_head"):
        TorchEngine(EngineOptions(model=str(model)))  # not tied: the head must be there
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.ones(63)
    save_file(bad, model / "model.safetensors")
    with pytest.raises(ModelConfigError, match=r"'model\.norm\.weight' has shape \(63,\)"):
        TorchEngine(EngineOptions(model=str(model)))
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelConfigError, match="cannot open the safetensors checkpoint"):
        TorchEngine(EngineOptions(model=str(model)))


def test_sharded_checkpoint(tmp_path, tiny_model, make_engine) -> None:
    src = tiny_model("qwen2")
    sharded = tmp_path / "sharded"
    src.reference.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    eut = make_engine(str(sharded))
    req = Request(rid=1, prompt=[9, 8, 7, 6, 5, 4], max_new_tokens=4)
    run_requests(eut.engine, eut.pool, [req])
    assert req.outputs == reference_greedy(src.reference, req.prompt, 4)[0]
    next(sharded.glob("model-*.safetensors")).unlink()
    with pytest.raises(ModelConfigError, match=r"names shard 'model-.*', which is missing"):
        TorchEngine(EngineOptions(model=str(sharded)))


def test_bad_options(tiny_model) -> None:
    path = tiny_model("llama").path
    with pytest.raises(ModelConfigError, match="unsupported dtype 'float8'"):
        TorchEngine(EngineOptions(model=path, dtype="float8"))
    with pytest.raises(ValueError, match="unknown attention backend 'magic'"):
        TorchEngine(EngineOptions(model=path, attention="magic"))


def test_pool_must_match_the_model(tiny_model) -> None:
    engine = TorchEngine(EngineOptions(model=tiny_model("llama").path))
    info = engine.info
    for kwargs in ({"num_layers": 3}, {"head_dim": 8}, {"dtype": "float16"}):
        shape = dict(num_layers=info.num_layers, num_pages=4, page_size=4, num_kv_heads=info.num_kv_heads)
        shape.update(head_dim=info.head_dim, dtype=info.kv_dtype)
        shape.update(kwargs)
        with pytest.raises(ValueError, match="does not match the model"):
            engine.bind(KVPool(**shape))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="before bind"):
        engine.forward([SeqInput(1, [0], 0, [1], True, SamplingParams())])


def test_bad_batches_fail_cleanly_and_the_engine_keeps_working(tiny_model, make_engine) -> None:
    model = tiny_model("llama")
    eut = make_engine(model.path, num_pages=8, page_size=4)
    greedy = SamplingParams(temperature=0.0)
    snapshot = [buf.copy() for buf in eut.pool.kv_buffers()]
    bad = [
        (SeqInput(1, [0], 0, [1, 2, 3, 4, 5], True, greedy), "need 2 pages, the page table has 1"),
        (SeqInput(1, [0, 1], 0, [1, 512], True, greedy), r"token id out of range \[0, 512\)"),
        (SeqInput(1, [0, 99], 0, [1, 2, 3, 4, 5], True, greedy), r"page id out of range \[0, 8\)"),
        (SeqInput(1, [0], 0, [], True, greedy), "no new tokens"),
        (SeqInput(1, [0], -1, [1], True, greedy), "num_cached must be >= 0"),
    ]
    for seq, message in bad:
        good = SeqInput(2, [5], 0, [3, 4], True, greedy)
        with pytest.raises(ValueError, match=message):
            eut.engine.forward([good, seq])
    # Validation runs before any KV write: the pool is untouched.
    for before, after in zip(snapshot, eut.pool.kv_buffers(), strict=True):
        assert np.array_equal(before, after)
    req = Request(rid=3, prompt=[3, 4, 5], max_new_tokens=3)
    run_requests(eut.engine, eut.pool, [req])
    assert req.outputs == reference_greedy(model.reference, req.prompt, 3)[0]
    assert eut.engine.forward([]) == []


def test_bfloat16_engine_over_a_bfloat16_pool(tiny_model, make_engine) -> None:
    model = tiny_model("llama")
    eut = make_engine(model.path, dtype="bfloat16")
    assert eut.pool.k[0].dtype == np.uint16  # bf16 words, viewed as torch.bfloat16 by the engine
    req = Request(rid=1, prompt=[5, 17, 99, 3, 250, 7], max_new_tokens=4, chunks=[2, 4])
    run_requests(eut.engine, eut.pool, [req])
    assert req.page_ids is not None and np.any(eut.pool.k[0][req.page_ids[0]] != 0)
    _, ref_logits = reference_greedy(model.reference, req.prompt, 1)
    assert req.logits is not None
    # bfloat16 keeps ~3 significant digits: the first step's logits stay close to float32's.
    assert (req.logits[0] - ref_logits[0]).abs().max().item() < 0.05


def test_attention_backend_choice_on_cpu(tiny_model) -> None:
    from workers.engines.llama import make_backend

    assert make_backend("auto", torch.device("cpu")).name == "torch_sdpa"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_backend("flashinfer", torch.device("cpu"))
    engine = TorchEngine(EngineOptions(model=tiny_model("llama").path, attention="torch_sdpa"))
    assert engine.attention.name == "torch_sdpa"


def test_device_pool_option() -> None:
    """KVPool(device=...) holds torch tensors (here on the 'meta' device, which needs no memory)."""
    pool = KVPool(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16", device="meta")
    assert isinstance(pool.k[0], torch.Tensor) and pool.k[0].dtype == torch.bfloat16
    assert pool.page_bytes == 4 * 2 * 8 * 2 and len(pool.kv_ptrs()) == 4
    assert pool.kv_data_lens() == [4 * pool.page_bytes] * 4
    with pytest.raises(RuntimeError, match="host memory"):
        pool.page_view(0, 0)


def test_engine_refuses_a_pool_on_another_device(tiny_model) -> None:
    engine = TorchEngine(EngineOptions(model=tiny_model("llama").path))
    info = engine.info
    pool = KVPool(
        num_layers=info.num_layers,
        num_pages=4,
        page_size=4,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        device="meta",
    )
    with pytest.raises(ValueError, match="pool memory is on meta"):
        engine.bind(pool)


def test_registered_as_the_torch_engine_plugin(tiny_model) -> None:
    from workers.engines import create_engine

    engine = create_engine("torch", EngineOptions(model=tiny_model("qwen2").path))
    assert isinstance(engine, TorchEngine)
    assert engine.info.tokenizer == os.path.abspath(tiny_model("qwen2").path)
    assert engine.info.eos_token_ids == ()  # tiny Qwen2 configs carry no EOS id


def test_padded_decode_slots_cannot_leak_nan_into_a_batch(tiny_model, make_engine) -> None:
    """A short sequence decoding beside a long one is padded to its length with slots it does not own (page
    0, the unwritten rows of its own last page): with an inf or NaN left there by another request (an fp16
    overflow, say), its masked weight 0 times that was NaN, and so were its logits. Now its tokens are the
    reference's whatever the padding holds."""
    model = tiny_model("llama")
    eut = make_engine(model.path, num_pages=16, page_size=4)
    junk = eut.pool.alloc(1)  # page 0, free again later: what a finished request left behind
    assert junk == [0]
    short, long = Request(rid=1, prompt=[5, 17, 99], max_new_tokens=4), Request(rid=2, prompt=list(range(3, 24)),
                                                                                 max_new_tokens=4)
    for buf in eut.pool.kv_buffers():
        buf[0] = np.nan
    run_requests(eut.engine, eut.pool, [short, long])
    assert short.outputs == reference_greedy(model.reference, short.prompt, 4)[0]
    assert long.outputs == reference_greedy(model.reference, long.prompt, 4)[0]


def test_a_row_that_cannot_be_sampled_is_reported_not_raised(tiny_model, make_engine, monkeypatch) -> None:
    """torch.multinomial raising for one row (NaN probabilities) left the whole batch's step to fail: the row
    comes back without a token (the scheduler fails that request), the others are sampled."""
    import workers.engines.llama.engine as engine_module

    real_sample = engine_module.sample

    def sample(logits, params, generator):  # type: ignore[no-untyped-def]
        if params.seed == 13:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", sample)
    eut = make_engine(tiny_model("llama").path, num_pages=8, page_size=4)
    bad, good = SamplingParams(temperature=1.0, seed=13), SamplingParams(temperature=1.0, seed=14)
    outs = eut.engine.forward([SeqInput(1, [0], 0, [3, 4], True, bad), SeqInput(2, [1], 0, [5, 6], True, good)])
    assert outs[0].token_id is None and outs[1].token_id is not None


def test_the_tokenizers_own_eos_token_ends_generation_too(tiny_model, tiny_tokenizer_dir, tmp_path) -> None:
    """vLLM and SGLang stop at the tokenizer's ``eos_token`` as well as the configs' EOS ids: a fine-tune that
    changed only ``tokenizer_config.json`` (to its template's end-of-turn) ran to ``max_tokens`` here."""
    import json
    import shutil

    from workers.engines.llama.config import load_config

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model("qwen2").path, model_dir)
    assert load_config(str(model_dir)).eos_token_ids == ()  # (no tokenizer: the configs name none)
    shutil.copy(os.path.join(tiny_tokenizer_dir, "tokenizer.json"), model_dir)
    shutil.copy(os.path.join(tiny_tokenizer_dir, "tokenizer_config.json"), model_dir)
    assert load_config(str(model_dir)).eos_token_ids == (2,)  # <|im_end|>
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": {"content": "<|endoftext|>"}}))
    assert load_config(str(model_dir)).eos_token_ids == (0,)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|not-a-token|>"}))
    assert load_config(str(model_dir)).eos_token_ids == ()
