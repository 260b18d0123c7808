"""The contract every routing policy must pass: built-ins, plugins, yours.

Use it from your own tests::

    from gateway.policies.contract import run_contract
    assert run_contract(lambda: MyPolicy(MyPolicy.Options(seed=1))) == []

or from the shell, for any installed policy (options as on the gateway's command line)::

    python -m gateway.policies.contract cache_aware cache_weight=2

``factory`` must build a fresh, identically configured policy each call (fix its seed, if it has
one). The checks call ``select`` on synthetic snapshots (``FakeWorker`` views with varied load and
cache contents) and the hooks the policy defines, and verify that the policy:

1. returns a ``Pair`` whose members come from the lists it was given (by identity; tuples, as the gateway gives
   them: a policy cannot sort or trim them in place);
2. never returns a worker it was not given, even one it favoured before: removed (``on_worker_removed``
   called) or unhealthy, draining or avoided by a retry (it just leaves the lists, no hook called);
3. works with one worker per role;
4. works in combined mode (no prefills: ``prefill`` is None);
5. is deterministic: two instances from ``factory`` make the same choices on the same inputs;
6. has bounded ``select`` cost: attribute reads on the views and cache look-ups grow at most
   linearly with the pool (measured at 64 and 512 workers), at most ``MAX_READS_PER_WORKER`` each, and so
   does the Python it runs (bytecode instructions counted at 32 and 256 workers: a policy that copies the
   figures out once, then compares every pair of workers, runs on the event loop for every request);
7. accepts every hook it defines (``on_dispatch``, ``on_finish``, ``on_worker_added``,
   ``on_worker_removed``) with the documented arguments;
8. defines ``select`` and these hooks as plain functions (an ``async def`` one would never run: the
   gateway calls them synchronously); checked first, the rest skipped when it fails.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.policies.base import OUTCOMES, Pair, Policy, RequestInfo, WorkerView
from gateway.policies.loader import async_members

MAX_READS_PER_WORKER = 64
PAGE_SIZE = 16
_reads = [0]  # attribute reads on FakeWorker views and cache look-ups, for the cost check


@dataclass(eq=False)
class FakeWorker:
    """A ``WorkerView`` with plain fields (every read is counted)."""

    url: str
    role: str
    page_size: int = PAGE_SIZE
    num_total_pages: int = 1024
    num_active: int = 0
    is_load_fresh: bool = True
    num_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 10_000.0
    busy_fraction: float = 0.0
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    max_running_seqs: int = 64
    num_free_pages: int = 1024
    num_reserved_pages: int = 0

    def __getattribute__(self, name: str) -> object:
        if not name.startswith("__"):
            _reads[0] += 1
        return object.__getattribute__(self, name)


class FakeLookup:
    """A prefix index stand-in: {url: leading pages held}, the same answer for every prompt."""

    def __init__(self, pages_by_url: Mapping[str, int]) -> None:
        self.pages_by_url = dict(pages_by_url)

    def match(self, hashes: Sequence[bytes]) -> Mapping[str, int]:
        _reads[0] += 1
        return {url: min(n, len(hashes)) for url, n in self.pages_by_url.items()}


def random_pool(rng: random.Random, num_prefill: int, num_decode: int) -> tuple[tuple[FakeWorker, ...],
                                                                                 tuple[FakeWorker, ...]]:
    """Prefills and decodes as the gateway gives them to ``select``: tuples (``Router.pick``), so that a policy
    which sorts or trims its lists in place fails here, as every request of its would in the gateway."""
    def worker(role: str, i: int) -> FakeWorker:
        total = rng.choice([256, 1024, 4096])
        running = rng.randrange(0, 32)
        return FakeWorker(
            url=f"pd://{role}-{i}:1", role=role, num_total_pages=total, num_active=rng.randrange(0, 16),
            num_prefill_tokens=rng.randrange(0, 20_000) if role == "prefill" else 0,
            prefill_tokens_per_s=rng.choice([0.0, 5_000.0, 20_000.0]) if role == "prefill" else 0.0,
            busy_fraction=rng.random(), num_running_seqs=running, num_waiting_seqs=rng.randrange(0, 4),
            num_free_pages=rng.randrange(0, total + 1), num_reserved_pages=rng.randrange(0, 8),
            is_load_fresh=rng.random() > 0.1,
        )

    return (tuple(worker("prefill", i) for i in range(num_prefill)),
            tuple(worker("decode", i) for i in range(num_decode)))


def random_request(rng: random.Random, prefills: Sequence[FakeWorker]) -> RequestInfo:
    n = rng.randrange(1, 3000)
    ids = [rng.randrange(0, 50_000) for _ in range(n)]
    cached = {w.url: rng.randrange(0, n // PAGE_SIZE + 1) for w in prefills if rng.random() < 0.5}
    return RequestInfo(ids, rng.randrange(1, 512), FakeLookup(cached))


def _check_pair(pair: object, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView]) -> None:
    assert isinstance(pair, Pair), f"select() must return a Pair, got {type(pair).__name__}"
    assert any(pair.decode is d for d in decodes), f"decode {pair.decode!r} is not one of the given decodes"
    if prefills:
        assert any(pair.prefill is p for p in prefills), f"prefill {pair.prefill!r} is not one of the given prefills"
    else:
        assert pair.prefill is None, "combined mode (no prefills): prefill must be None"


def _hook(policy: Policy, name: str) -> Callable[..., None] | None:
    fn = getattr(policy, name, None)
    return fn if callable(fn) else None


def _drive(policy: Policy, rng: random.Random, steps: int, sizes: Sequence[tuple[int, int]]) -> list[tuple[str, str]]:
    """Select on varied snapshots, calling the hooks as the gateway would; returns the choices."""
    choices = []
    added, dispatch, finish = _hook(policy, "on_worker_added"), _hook(policy, "on_dispatch"), _hook(policy, "on_finish")
    for step in range(steps):
        prefills, decodes = random_pool(rng, *sizes[step % len(sizes)])
        if added is not None:
            for w in (*prefills, *decodes):
                added(w)
        request = random_request(rng, prefills)
        pair = policy.select(prefills, decodes, request)
        _check_pair(pair, prefills, decodes)
        if dispatch is not None:
            dispatch(pair, request)
        if finish is not None:
            finish(pair, request, OUTCOMES[step % len(OUTCOMES)])
        choices.append((pair.prefill.url if pair.prefill is not None else "", pair.decode.url))
    return choices


def check_returns_members(factory: Callable[[], Policy]) -> None:
    _drive(factory(), random.Random(1), 200, [(4, 2), (3, 5), (16, 16), (2, 1)])


def check_never_unhealthy(factory: Callable[[], Policy]) -> None:
    """A worker the policy liked (idle, everything cached) leaves the lists: never chosen again, whether it
    was removed (the hook is called) or is unhealthy, draining or avoided (it only leaves the lists)."""
    _never_after_leaving(factory(), removed=True)
    _never_after_leaving(factory(), removed=False)


def _never_after_leaving(policy: Policy, *, removed: bool) -> None:
    rng = random.Random(2)
    hook = _hook(policy, "on_worker_removed") if removed else None
    prefills, decodes = random_pool(rng, 4, 3)
    star_p, star_d = prefills[0], decodes[0]
    star_p.num_prefill_tokens, star_p.prefill_tokens_per_s = 0, 1e9
    star_d.num_free_pages, star_d.num_running_seqs, star_d.num_waiting_seqs = star_d.num_total_pages, 0, 0
    seen = [random_request(rng, prefills) for _ in range(20)]
    for request in seen:  # let stateful policies learn to like it (and remember these prompts)
        request._lookup = FakeLookup({star_p.url: 1000})
        _check_pair(policy.select(prefills, decodes, request), prefills, decodes)
    if hook is not None:
        hook(star_p)
        hook(star_d)
    for i in range(100):  # the prompts seen before, then new ones
        request = seen[i] if i < len(seen) else random_request(rng, prefills)
        request._lookup = FakeLookup({star_p.url: 1000})
        pair = policy.select(prefills[1:], decodes[1:], request)
        how = "removed" if removed else "unhealthy: no hook called"
        try:
            _check_pair(pair, prefills[1:], decodes[1:])
        except AssertionError as exc:
            raise AssertionError(f"{exc} (after a worker it liked left the lists, {how})") from None
        assert pair.prefill is not star_p and pair.decode is not star_d, f"chose a worker that left the pool ({how})"


def check_one_worker_per_role(factory: Callable[[], Policy]) -> None:
    _drive(factory(), random.Random(3), 50, [(1, 1)])


def check_combined_mode(factory: Callable[[], Policy]) -> None:
    _drive(factory(), random.Random(4), 50, [(0, 1), (0, 4), (0, 32)])


def check_deterministic(factory: Callable[[], Policy]) -> None:
    sizes = [(4, 2), (8, 8), (3, 1)]
    first = _drive(factory(), random.Random(5), 150, sizes)
    second = _drive(factory(), random.Random(5), 150, sizes)
    diverged = next((i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b), None)
    assert diverged is None, f"two instances from the factory chose differently at call {diverged} (fix the seed)"


def _reads_per_select(policy: Policy, n: int) -> float:
    rng = random.Random(6)
    prefills, decodes = random_pool(rng, n, n)
    requests = [random_request(rng, prefills) for _ in range(5)]
    policy.select(prefills, decodes, requests[0])  # warm-up (lazy set-up)
    before = _reads[0]
    for request in requests:
        policy.select(prefills, decodes, request)
    return (_reads[0] - before) / len(requests)


def _instructions_per_select(policy: Policy, n: int) -> int:
    """Bytecode instructions one ``select`` runs (its own and every Python function it calls), counted by a
    tracer: the same on every machine, unlike its time."""
    rng = random.Random(7)
    prefills, decodes = random_pool(rng, n, n)
    request = random_request(rng, prefills)
    policy.select(prefills, decodes, request)  # warm-up (lazy set-up)
    count = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            count[0] += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        policy.select(prefills, decodes, request)
    finally:
        sys.settrace(previous)
    return count[0]


def check_bounded_cost(factory: Callable[[], Policy]) -> None:
    small, large = _reads_per_select(factory(), 64), _reads_per_select(factory(), 512)
    per_worker = large / (2 * 512)
    assert per_worker <= MAX_READS_PER_WORKER, f"{per_worker:.0f} view reads per worker per select() at 512 workers"
    assert large <= 8 * small * 1.5 + 64, (
        f"select() cost grows faster than linearly: {small:.0f} reads at 64 workers, {large:.0f} at 512")
    small, large = _instructions_per_select(factory(), 32), _instructions_per_select(factory(), 256)
    assert large <= 8 * small * 1.5 + 2000, (
        f"select() cost grows faster than linearly: {small} bytecode instructions at 32 workers, {large} at 256")


def check_synchronous(factory: Callable[[], Policy]) -> None:
    asynchronous = async_members(factory())
    assert not asynchronous, f"{', '.join(asynchronous)} must be plain functions, not async (called synchronously)"


def check_hooks_accept_calls(factory: Callable[[], Policy]) -> None:
    policy, rng = factory(), random.Random(7)
    prefills, decodes = random_pool(rng, 2, 2)
    request = random_request(rng, prefills)
    pair = policy.select(prefills, decodes, request)
    for name, args in (("on_worker_added", (prefills[0],)), ("on_dispatch", (pair, request)),
                       *((("on_finish", (pair, request, o))) for o in OUTCOMES),
                       ("on_worker_removed", (prefills[1],)), ("on_worker_removed", (decodes[1],))):
        fn = _hook(policy, name)
        if fn is not None:
            fn(*args)
    _check_pair(policy.select(prefills[:1], decodes[:1], request), prefills[:1], decodes[:1])


CHECKS: dict[str, Callable[[Callable[[], Policy]], None]] = {
    "synchronous": check_synchronous,  # (first: the others cannot run an async policy)
    "returns_members": check_returns_members,
    "never_unhealthy": check_never_unhealthy,
    "one_worker_per_role": check_one_worker_per_role,
    "combined_mode": check_combined_mode,
    "deterministic": check_deterministic,
    "bounded_cost": check_bounded_cost,
    "hooks_accept_calls": check_hooks_accept_calls,
}


def run_contract(factory: Callable[[], Policy]) -> list[str]:
    """Run every check; returns the failures as "check: message" lines (empty when it passes)."""
    failures = []
    for name, check in CHECKS.items():
        try:
            check(factory)
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            if check is check_synchronous:
                break
    return failures


def main(argv: list[str] | None = None) -> int:
    from gateway.policies.loader import create_policy, load_policy_class, option_names

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m gateway.policies.contract POLICY [KEY=VALUE ...]", file=sys.stderr)
        return 2
    name, options = args[0], dict(a.partition("=")[::2] for a in args[1:])
    try:
        if "seed" in option_names(load_policy_class(name)):
            options.setdefault("seed", "1")
        create_policy(name, options)  # (a policy that cannot be built runs no check: said as such, not as a traceback)
    except Exception as exc:  # (plugin and option errors name the policy and what is wrong)
        print(f"{name}: cannot build the policy: {exc}", file=sys.stderr)
        return 2
    failures = run_contract(lambda: create_policy(name, options))
    for line in failures:
        print(f"FAIL {line}")
    skipped = len(CHECKS) - len(failures) if any(f.startswith("synchronous:") for f in failures) else 0
    more = f", {skipped} not run (after the synchronous check failed)" if skipped else ""
    print(f"{name}: {len(CHECKS) - len(failures) - skipped}/{len(CHECKS)} checks passed{more}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
