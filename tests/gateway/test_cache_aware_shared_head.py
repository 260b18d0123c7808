"""cache_aware: tenants whose prompts share a short head (a chat template's system header, a common
preamble) must still spread over the prefills at light load, not pile onto whichever prefill computed
that head first (its cache then thrashes while the others sit empty)."""

from collections import Counter

from gateway.policies.cache_aware import CacheAwarePolicy
from gateway.policies.contract import FakeWorker
from gateway.prefix_index import PrefixIndex
from gateway.router import Router
from workers.page_cache import page_hashes
from workers.protocol import KVEvents

HEAD = list(range(900, 932))  # two pages every prompt shares (e.g. "<|im_start|>system\nYou are a helpful ...")


def _prompt(tenant: int, question: int) -> list[int]:
    system = [10_000 + tenant * 2000 + i for i in range(1700)]
    return [*HEAD, *system, *(50_000 + question * 10 + i for i in range(20))]


def test_cache_aware_spreads_tenants_behind_a_shared_head_at_light_load() -> None:
    policy = CacheAwarePolicy()
    router = Router(policy, policy, PrefixIndex())
    prefills = [FakeWorker(f"pd://p{i}:1", "prefill") for i in range(3)]
    decode = FakeWorker("pd://d:1", "decode")
    homes: dict[int, Counter] = {}
    for n in range(90):  # one request at a time (light load): 9 tenants in turn
        tenant = n % 9
        ids = _prompt(tenant, n)
        request = router.request(ids, 4)
        pair = router.select(prefills, [decode], request)
        router.dispatched(pair, request)
        # the chosen prefill computes the prompt and publishes its full pages (its KV events)
        router.kv_events(pair.prefill, KVEvents(stored=page_hashes(ids, 16, (len(ids) - 1) // 16)))
        homes.setdefault(tenant, Counter())[pair.prefill.url] += 1
    used = Counter(url for c in homes.values() for url in c)
    # 9 tenants x ~110 pages: far more than one prefill's 1024-page pool holds, a third of them each on three
    assert len(used) == 3, f"every tenant went to {sorted(used)}: one prefill's cache holds them all?"
    assert max(used.values()) <= 45, dict(used)
    assert all(len(c) == 1 for t, c in homes.items()), {t: dict(c) for t, c in homes.items()}  # and they stick
