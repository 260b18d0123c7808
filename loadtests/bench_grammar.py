"""Grammar libraries compared on this machine: compile time and next-token mask time on SmolLM2's vocabulary.

    python loadtests/bench_grammar.py [--libs xgrammar,llguidance,outlines-core] [--rounds 5]

For each installed library: the time to compile a realistic JSON Schema (an order with nested objects,
arrays, enums, a pattern and optional fields) against SmolLM2-135M's tokenizer (49,152 tokens), the
first compile of a cold compiler and a warm recompile of a fresh schema, then the mean and p99 time to
compute the allowed-token mask per generated token while a valid answer (the canonical tokenization
of an instance) is fed through the matcher, and the time to apply that mask to a [1, vocab] logits row.
Also a regex (``sampling_params.regex``) compile. A library that is not importable is skipped; only
llguidance is a project dependency. To compare, install the others beside the venv without their
dependencies (xgrammar's would pull triton) and put them on the path:

    pip install --no-deps --target /tmp/gramlib xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 outlines-core==0.2.14
    PYTHONPATH=/tmp/gramlib:. python loadtests/bench_grammar.py

    python loadtests/bench_grammar.py --decode [--batches 1,16] [--steps 24]

measures instead what a constraint costs the torch engine: SmolLM2 greedy decode tokens/s at each batch
size, every sequence unconstrained, then every sequence under the JSON Schema above (llguidance), in
the same process one after the other (compile done before the timing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "gift": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "gift", "notes"],
    "additionalProperties": False,
}
INSTANCE = {
    "order_id": "ABC-1234",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
    "items": [{"sku": "X-1", "quantity": 2, "price": 9.5}, {"sku": "Y-22", "quantity": 1, "price": 120.0}],
    "gift": False,
    "notes": None,
}
REGEX = r"(Paris|London|Berlin), population [0-9]{1,8}\."


def _schema_variant(i: int) -> dict[str, Any]:
    variant = json.loads(json.dumps(SCHEMA))
    variant["properties"][f"extra_{i}"] = {"type": "integer"}
    return variant


class Lib:
    name = ""

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        raise NotImplementedError

    def compile_schema(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def compile_regex(self, regex: str) -> Any:
        raise NotImplementedError

    def run(self, compiled: Any, tokens: list[int]) -> tuple[list[float], float]:
        """Per-token mask seconds, and apply seconds (one [1, V] row), feeding ``tokens``."""
        raise NotImplementedError


class XGrammar(Lib):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab = vocab
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def compile_regex(self, regex: str) -> Any:
        return self.compiler.compile_regex(regex)

    def run(self, compiled: Any, tokens: list[int]) -> tuple[list[float], float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        times = []
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(t), f"xgrammar refused token {t}"
        logits = torch.randn(1, self.vocab)
        start = time.perf_counter()
        self.xgr.apply_token_bitmask_inplace(logits, mask)
        return times, time.perf_counter() - start


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.vocab = vocab
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def compile_schema(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.llg.LLMatcher(self.tok, grammar)  # compiles lazily: force the first mask
        matcher.compute_bitmask()
        return grammar

    def compile_regex(self, regex: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_regex(regex)
        self.llg.LLMatcher(self.tok, grammar).compute_bitmask()
        return grammar

    def run(self, compiled: Any, tokens: list[int]) -> tuple[list[float], float]:
        matcher = self.llg.LLMatcher(self.tok, compiled)
        mask = self.llg.torch.allocate_token_bitmask(1, self.vocab)
        times = []
        for t in tokens:
            start = time.perf_counter()
            self.llg.torch.fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(t), f"llguidance refused token {t}: {matcher.get_error()}"
        logits = torch.randn(1, self.vocab)
        start = time.perf_counter()
        self.llg.torch.apply_token_bitmask_inplace(logits, mask)
        return times, time.perf_counter() - start


class OutlinesCore(Lib):
    name = "outlines-core"

    def __init__(self, tokenizer: Any, vocab: int, eos: int) -> None:
        import outlines_core
        import outlines_core.json_schema
        import outlines_core.kernels.torch

        self.oc = outlines_core
        self.vocab_size, self.eos = vocab, eos
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id == eos or token_id >= vocab:
                continue
            try:
                raw = bytes(byte_of[c] for c in token)
            except KeyError:  # special tokens are not byte-level text
                continue
            tokens.setdefault(raw, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)

    def compile_schema(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="[ ]?")
        return self.oc.Index(regex, self.vocabulary)

    def compile_regex(self, regex: str) -> Any:
        return self.oc.Index(regex, self.vocabulary)

    def run(self, compiled: Any, tokens: list[int]) -> tuple[list[float], float]:
        kt = self.oc.kernels.torch
        guide = self.oc.Guide(compiled)
        mask = kt.allocate_token_bitmask(self.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            kt.fill_next_token_bitmask(guide, mask)
            times.append(time.perf_counter() - start)
            if t != self.eos:  # a finished guide has no transition on EOS
                guide.advance(t)
        logits = torch.randn(1, self.vocab_size)
        start = time.perf_counter()
        kt.apply_token_bitmask_inplace(logits, mask)
        return times, time.perf_counter() - start


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character standing for it in token strings."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


LIBS: dict[str, Callable[..., Lib]] = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def bench_decode(batches: list[int], steps: int, repeats: int) -> None:
    """The torch engine on SmolLM2: greedy decode tokens/s per batch size, unconstrained and under SCHEMA."""
    from workers.engines.base import EngineOptions, SeqInput
    from workers.engines.llama import TorchEngine
    from workers.kv_pool import KVPool
    from workers.protocol import Grammar, SamplingParams

    engine = TorchEngine(EngineOptions(num_threads=1))
    info = engine.info
    length, page_size = 32, 16
    pool = KVPool(num_layers=info.num_layers, num_pages=max(batches) * -(-(length + steps + 1) // page_size),
                  page_size=page_size, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=info.kv_dtype)
    engine.bind(pool)
    free = SamplingParams(temperature=0.0)
    constrained = SamplingParams(temperature=0.0, grammar=Grammar("json_schema", json.dumps(SCHEMA)))
    engine.prepare(constrained.grammar).result()  # type: ignore[arg-type]  # compile outside the timing
    constraint_s = [0.0]  # time inside the engine's grammar calls (mask + accept), summed

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                constraint_s[0] += time.perf_counter() - start
        return call

    engine.constraints.mask = timed(engine.constraints.mask)  # type: ignore[method-assign]
    engine.constraints.accept = timed(engine.constraints.accept)  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    print(f"decode tokens/s, SmolLM2-135M, {steps} greedy steps after a {length}-token prompt, median of {repeats}"
          " (the two modes interleaved); grammar_ms: the constraint's own time per step (mask + accept)")
    print(f"{'batch':>5} {'unconstrained':>14} {'json_schema':>12} {'ratio':>6} {'grammar_ms':>11}")
    rid = 0
    for batch in batches:
        prompts = [torch.randint(3, info.vocab_size, (length,), generator=gen).tolist() for _ in range(batch)]
        times: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(repeats):
            for mode, params in enumerate((free, constrained)):
                pages = [pool.alloc(pool.pages_for(length + steps + 1)) or [] for _ in prompts]
                rids = list(range(rid, rid + batch))
                rid += batch
                out = engine.forward([SeqInput(r, pg, 0, p, True, params, 0, p)
                                      for r, pg, p in zip(rids, pages, prompts, strict=True)])
                last = [o.token_id or 0 for o in out]
                constraint_s[0] = 0.0
                start = time.perf_counter()
                for step in range(steps):
                    out = engine.forward([SeqInput(r, pg, length + step, [t], True, params, step + 1)
                                          for r, pg, t in zip(rids, pages, last, strict=True)])
                    last = [o.token_id or 0 for o in out]
                times[mode].append(time.perf_counter() - start)
                grammar_ms = constraint_s[0] / steps * 1e3
                for r, pg in zip(rids, pages, strict=True):
                    engine.forget(r)
                    pool.free(pg)
        free_rate, constrained_rate = (batch * steps / statistics.median(times[m]) for m in (0, 1))
        print(f"{batch:>5} {free_rate:>14.1f} {constrained_rate:>12.1f} {constrained_rate / free_rate:>6.2f} "
              f"{grammar_ms:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", default=",".join(LIBS))
    parser.add_argument("--rounds", type=int, default=5, help="instances fed per library (mask times pooled)")
    parser.add_argument("--decode", action="store_true",
                        help="instead: decode tokens/s of the torch engine with and without a JSON-schema constraint")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.decode:
        bench_decode([int(b) for b in args.batches.split(",")], args.steps, args.repeats)
        return
    from transformers import AutoTokenizer

    from workers.engines.llama.gguf_convert import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    vocab, eos = 49152, 2
    text = json.dumps(INSTANCE)  # separators ", " and ": ", as each library is configured
    tokens = [*tokenizer.encode(text, add_special_tokens=False), eos]
    print(f"vocab {vocab}, schema {len(json.dumps(SCHEMA))} chars, answer {len(tokens)} tokens")
    print(f"{'library':<14} {'setup_ms':>9} {'compile_ms':>11} {'recompile_ms':>13} {'regex_ms':>9} "
          f"{'mask_us_mean':>13} {'mask_us_p99':>12} {'apply_us':>9}")
    for name in args.libs.split(","):
        try:
            start = time.perf_counter()
            lib = LIBS[name](tokenizer, vocab, eos)
            setup_ms = (time.perf_counter() - start) * 1e3
        except ImportError as exc:
            print(f"{name:<14} not installed ({exc})")
            continue
        start = time.perf_counter()
        compiled = lib.compile_schema(SCHEMA)
        compile_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        lib.compile_schema(_schema_variant(1))
        recompile_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        lib.compile_regex(REGEX)
        regex_ms = (time.perf_counter() - start) * 1e3
        masks: list[float] = []
        applies: list[float] = []
        for _ in range(args.rounds):
            times, apply_s = lib.run(compiled, tokens)
            masks += times
            applies.append(apply_s)
        masks.sort()
        p99 = masks[min(len(masks) - 1, int(0.99 * len(masks)))]
        print(f"{name:<14} {setup_ms:>9.1f} {compile_ms:>11.1f} {recompile_ms:>13.1f} {regex_ms:>9.1f} "
              f"{statistics.mean(masks) * 1e6:>13.1f} {p99 * 1e6:>12.1f} {statistics.median(applies) * 1e6:>9.1f}")


if __name__ == "__main__":
    main()
