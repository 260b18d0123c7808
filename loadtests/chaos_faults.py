"""The chaos runner's faults and the state they act on (``ChaosRun``), with the monitor's live checks.

Lifecycle (``loadtests/chaos.py`` drives it; event loop only):
1. ``ChaosRun(config, log_dir)`` plans the cluster (``chaos_cluster``) with settings that make faults
   visible in seconds (``GATEWAY_ARGS``, ``WORKER_ARGS``).
2. A fault (``FAULTS[name](run)``) names the workers it acts on (``run.target``), injects (SIGKILL,
   SIGSTOP, admin API, a burst of leaving clients), holds, undoes itself (restart on the same ports,
   SIGCONT, re-add), and returns what it hit. ``wait_recovered`` then waits until every child is up,
   every worker is healthy in the gateway's view and every prefill is registered again.
3. ``monitor()`` runs for the whole load: every half second it checks that the gateway is the same
   live process and answers, that no child died by itself, that no client is past its deadline, and
   that no breaker opened on a worker the current fault is not acting on (a failure held against
   the wrong worker). Violations go to ``report``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from chaos_cluster import ChaosCluster, Child, ClusterConfig
from chaos_load import Load, hung_now
from chaos_report import Report

if TYPE_CHECKING:
    from chaos import ChaosConfig

CI_FAULTS = ("kill-prefill", "kill-decode", "kill-registry", "stop-decode", "freeze-transfer", "remove-worker",
             "disconnect", "kill-decode-stop-prefill")
ALL_FAULTS = (*CI_FAULTS, "stop-prefill")
# Faults are seen in seconds: probes every 0.5 s (2 misses = unhealthy), short deadlines; a killed worker's
# breaker (opened by its own requests) half-opens after 2 s, not 30, so a restart is back within the run.
GATEWAY_ARGS = ("--health-interval-s", "0.5", "--health-timeout-s", "1", "--unhealthy-after", "2",
                "--healthy-after", "2", "--breaker-cooldown-s", "2", "--first-token-timeout-s", "10",
                "--stream-idle-timeout-s", "5", "--drain-timeout-s", "5")
WORKER_ARGS = ("--heartbeat-interval-s", "0.5", "--transfer-timeout-s", "4", "--waiting-timeout-s", "10",
               "--bootstrap-timeout-s", "10")
PREFILL_ARGS = ("--chunk-size", "32", "--engine-option", "prefill_token_s=0.0005")
DECODE_ARGS = ("--engine-option", "decode_step_s=0.01")
HOLD_S = {"kill": 1.0, "registry": 1.5, "stop": 4.0, "remove": 0.5}
RECOVER_TIMEOUT_S = 30.0


class ChaosRun:
    """One run's state: the cluster, the load, the report, and the faults acting on them."""

    def __init__(self, config: ChaosConfig, log_dir: Path) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.cluster = ChaosCluster(ClusterConfig(
            transfer=config.transfer, num_prefill=config.num_prefill, num_decode=config.num_decode,
            max_migrations=config.max_migrations, worker_args=WORKER_ARGS, prefill_args=PREFILL_ARGS,
            decode_args=DECODE_ARGS, gateway_args=GATEWAY_ARGS, log_dir=log_dir))
        self.report = Report(config, log_dir=log_dir)
        self.down: set[str] = set()  # children a fault has taken down on purpose
        self.targets: set[str] = set()  # URLs of the workers the current fault acts on
        self.fault = ""  # the current fault, for the monitor's messages
        self.load: Load | None = None

    # -- faults ------------------------------------------------------------------------------
    async def kill_restart(self, child: Child, hold_s: float) -> None:
        self.down.add(child.name)
        child.kill()
        await asyncio.sleep(hold_s)
        await self.cluster.restart(child)
        self.down.discard(child.name)

    def target(self, child: Child) -> Child:
        """``child`` is what the current fault acts on (its breaker may open; no other's may)."""
        self.targets.add(child.url)
        return child

    async def freeze_thaw(self, child: Child, hold_s: float) -> None:
        child.freeze()
        try:
            await asyncio.sleep(hold_s)
        finally:
            child.thaw()

    async def busiest(self, workers: list[Child]) -> Child:
        """The worker the gateway has most requests open on (waits briefly for one to have some)."""
        deadline = time.monotonic() + 3.0
        while True:
            view = await self.cluster.gateway_workers()
            ranked = sorted(workers, key=lambda w: -view.get(w.url, {}).get("active", 0))
            if view.get(ranked[0].url, {}).get("active", 0) > 0 or time.monotonic() > deadline:
                return ranked[0]
            await asyncio.sleep(0.05)

    async def mid_transfer(self, prefill: Child) -> bool:
        """Wait (up to 5 s) until ``prefill`` is computing and sending KV; False if it never was."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            load = await self.cluster.load(prefill)
            if load.get("num_inflight_transfers") or load.get("num_running"):
                return True
            await asyncio.sleep(0.005)
        return False

    async def wait_recovered(self) -> bool:
        cluster = self.cluster
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                view = await cluster.gateway_workers()
                # (a half-open breaker is still on probation after the fault: recovered once it closed)
                if (all(c.is_alive for c in cluster.children)
                        and all(view.get(w.url, {}).get("healthy") and view[w.url].get("breaker") == "closed"
                                for w in cluster.workers)
                        and await cluster.registered_instances() >= len(cluster.prefills)):
                    return True
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.1)
        return False

    def why_opened(self, url: str) -> str:
        """The gateway's own log line for the last time it opened ``url``'s breaker."""
        lines = [ln for ln in self.cluster.gateway.log_text().splitlines() if f"{url}: breaker opened" in ln]
        return lines[-1].strip() if lines else "the gateway logged no reason"

    # -- monitor -----------------------------------------------------------------------------
    async def monitor(self) -> None:
        cluster, report = self.cluster, self.report
        misses = 0
        while True:
            await asyncio.sleep(0.5)
            if not cluster.gateway.is_alive or cluster.gateway.pid != cluster.gateway_pid:
                report.violate("the gateway process died or was replaced")
            for child in cluster.children:
                if child.name not in self.down and not child.is_alive and child is not cluster.gateway:
                    report.violate(f"{child.name} exited by itself (code {child.proc and child.proc.returncode})")
            if self.load is not None:
                for hung in hung_now(self.load, time.monotonic()):
                    report.violate(f"{hung} still open past its deadline")
            try:
                health = await cluster.gateway_health(timeout_s=5.0)
                misses = 0
                for worker in health["workers"]:
                    if worker["breaker"] == "open" and worker["url"] not in self.targets:
                        name = next((w.name for w in cluster.workers if w.url == worker["url"]), worker["url"])
                        report.violate(f"{name}'s breaker opened during {self.fault or 'no fault'}: a fault it was "
                                       f"not part of was held against it ({self.why_opened(worker['url'])})")
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                misses += 1
                if misses >= 3:
                    report.violate("the gateway did not answer /health 3 times in a row")


async def _kill_prefill(run: ChaosRun) -> str:
    victim = run.target(run.rng.choice(run.cluster.prefills))
    await run.kill_restart(victim, HOLD_S["kill"])
    return victim.name


async def _kill_decode(run: ChaosRun) -> str:
    victim = run.target(await run.busiest(run.cluster.decodes))  # one with streams on it: they must migrate
    await run.kill_restart(victim, HOLD_S["kill"])
    return victim.name


async def _kill_registry(run: ChaosRun) -> str:
    await run.kill_restart(run.cluster.registry, HOLD_S["registry"])
    return "registry"


async def _stop_decode(run: ChaosRun) -> str:
    victim = run.target(await run.busiest(run.cluster.decodes))
    await run.freeze_thaw(victim, HOLD_S["stop"])
    return victim.name


async def _stop_prefill(run: ChaosRun) -> str:
    victim = run.target(run.rng.choice(run.cluster.prefills))
    await run.freeze_thaw(victim, HOLD_S["stop"])
    return victim.name


async def _kill_decode_stop_prefill(run: ChaosRun) -> str:
    """Two at once: the streams of the killed decode migrate while a prefill they may land on is frozen."""
    prefill = run.target(run.rng.choice(run.cluster.prefills))
    decode = run.target(await run.busiest(run.cluster.decodes))
    prefill.freeze()
    try:
        await run.kill_restart(decode, HOLD_S["stop"])
    finally:
        prefill.thaw()
    return f"{decode.name}+{prefill.name}"


async def _freeze_transfer(run: ChaosRun) -> str:
    victim = run.target(run.rng.choice(run.cluster.prefills))
    caught = await run.mid_transfer(victim)
    await run.freeze_thaw(victim, HOLD_S["stop"])  # past the decode's KV heartbeat timeout and the probes
    return victim.name if caught else f"{victim.name} (idle)"


async def _remove_worker(run: ChaosRun) -> str:
    cluster = run.cluster
    victim = run.target(run.rng.choice(cluster.workers))
    status = await cluster.remove_worker(victim)
    if status != 202:
        run.report.violate(f"DELETE /workers {victim.name} answered {status}, not 202")
    deadline = time.monotonic() + RECOVER_TIMEOUT_S
    while victim.url in await cluster.gateway_workers():
        if time.monotonic() > deadline:
            run.report.violate(f"{victim.name} still listed {RECOVER_TIMEOUT_S:g}s after its removal")
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(HOLD_S["remove"])
    status = await cluster.add_worker(victim)
    if status != 201:
        run.report.violate(f"POST /workers {victim.name} answered {status}, not 201")
    return victim.name


async def _disconnect(run: ChaosRun) -> str:
    assert run.load is not None
    count = 2 * run.config.concurrency
    await run.load.burst(count)
    return f"{count} clients"


FAULTS: dict[str, Callable[[ChaosRun], Awaitable[str]]] = {
    "kill-prefill": _kill_prefill, "kill-decode": _kill_decode, "kill-registry": _kill_registry,
    "stop-decode": _stop_decode, "stop-prefill": _stop_prefill, "freeze-transfer": _freeze_transfer,
    "remove-worker": _remove_worker, "disconnect": _disconnect, "kill-decode-stop-prefill": _kill_decode_stop_prefill,
}
