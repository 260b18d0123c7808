"""Chaos runner: a real PD cluster under steady load and a schedule of faults, its invariants checked throughout.

Lifecycle of a run (``run(config)``, one event loop):
1. Start a registry, ``--prefill`` prefill and ``--decode`` decode sim workers over ``--transfer``,
   and a gateway with migration on (``chaos_cluster.ChaosCluster``; short health and deadline
   settings so faults are seen in seconds). Build the reference texts (``chaos_load.Reference``).
2. Start ``--concurrency`` closed-loop clients (``chaos_load.Load``): streams, whole requests,
   streams the client leaves, whole requests the client hangs up on.
3. Run the fault schedule, spread over ``--duration-s`` (``--fault-every-s`` cycles it for a long
   run): each fault injects, holds, undoes itself, then the runner waits until the cluster has
   recovered (every child up, every worker healthy in the gateway's view with its breaker closed, every
   prefill registered: a breaker half-open after the fault is still on probation).
   Meanwhile a monitor checks, every half second, that the gateway is the same live process and
   answers, that no child died by itself, and that no client is past its deadline.
4. Stop the load, let the cluster go idle, then check the end invariants: nothing hung, no unclear
   failure, no wrong text, no started stream failed (migration on), the gateway's in-flight counters
   and every worker's queues at zero, every KV pool full again, the gateway never restarted.
5. Print the summary (requests, faults, migrations, pages leaked, throughput during and after each
   fault) and exit 1 when an invariant failed. Every child is reaped in ``finally``.

    .venv/bin/python loadtests/chaos.py                                   # CI-sized (~1 min), tcp
    .venv/bin/python loadtests/chaos.py --transfer nixl --seed 3
    .venv/bin/python loadtests/chaos.py --duration-s 600 --fault-every-s 8 --concurrency 24   # by hand
Mooncake needs a private network namespace: ``unshare --net -- sh -c 'ip link set lo up && ...'``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from chaos_cluster import count_tracebacks, kv_mismatches
from chaos_faults import ALL_FAULTS, CI_FAULTS, FAULTS, RECOVER_TIMEOUT_S, ChaosRun
from chaos_load import Load, Reference, Result, make_prompts
from chaos_report import FaultRecord, Report, summary
from stop_signals import stop_like_ctrl_c

WARMUP_S, TAIL_S, GAP_S = 3.0, 4.0, 1.0  # load before the first fault, after the last; least gap between


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 50.0
    seed: int = 0
    transfer: str = "tcp"
    concurrency: int = 12
    faults: tuple[str, ...] = CI_FAULTS
    fault_every_s: float | None = None  # None: the list once, spread over the run; else cycled at this pace
    num_prefill: int = 2
    num_decode: int = 2
    max_migrations: int = 2
    request_timeout_s: float = 60.0
    num_prompts: int = 20
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"faults: unknown {', '.join(unknown)} (known: {', '.join(FAULTS)})")
        if self.num_prefill < 2 or self.num_decode < 2:
            raise ValueError("num_prefill/num_decode: at least 2 each (a fault must leave one standing)")
        if self.concurrency < 1 or not self.duration_s > 0:
            raise ValueError("concurrency and duration_s must be positive")


async def _schedule(run: ChaosRun, t_end: float) -> None:
    config, report = run.config, run.report
    names = list(config.faults)
    once = config.fault_every_s is None
    slot_s = (config.duration_s - WARMUP_S - TAIL_S) / max(1, len(names)) if once else config.fault_every_s
    assert slot_s is not None
    t_next = time.monotonic() + WARMUP_S
    t_quiet = t_next  # when the last fault had recovered
    i = 0
    while names and (i < len(names) if once else time.monotonic() + slot_s < t_end):
        await asyncio.sleep(max(0.0, t_next - time.monotonic()))
        name = names[i % len(names)]
        before = (await run.cluster.metrics()).get("pd_gateway_migrations_total", 0.0)
        record = FaultRecord(name, "", time.monotonic())
        if report.faults:
            report.faults[-1].t_next = record.t_inject
        report.faults.append(record)
        run.fault = name
        record.target = await FAULTS[name](run)
        record.recovered = await run.wait_recovered()
        run.fault, run.targets = "", set()
        record.t_recovered = t_quiet = time.monotonic()
        if not record.recovered:
            report.violate(f"not recovered {RECOVER_TIMEOUT_S:g}s after {name} ({record.target})")
        record.migrations = (await run.cluster.metrics()).get("pd_gateway_migrations_total", 0.0) - before
        t_next = max(t_next + slot_s, time.monotonic() + GAP_S)
        i += 1
    await asyncio.sleep(max(0.0, t_end - time.monotonic(), t_quiet + TAIL_S - time.monotonic()))


async def _settle(run: ChaosRun) -> None:
    """After the load: the gateway's counters and every worker's queues back to zero, pools full."""
    cluster, report = run.cluster, run.report
    deadline = time.monotonic() + 30.0
    while True:
        try:
            health = await cluster.gateway_health()
            metrics = await cluster.metrics()
            loads = {w.name: await cluster.load(w) for w in cluster.workers if w.is_alive}
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            if time.monotonic() > deadline:
                report.violate(f"the cluster did not answer after the load: {type(exc).__name__}: {exc}")
                return
            await asyncio.sleep(0.2)
            continue
        open_on = {w["url"]: w["active"] for w in health["workers"] if w["active"]}
        counters = (health["active_requests"], health["queued_requests"], metrics.get("pd_gateway_active_requests"),
                    metrics.get("pd_gateway_queued_requests"))
        busy = {name: ld for name, ld in loads.items() if ld.get("num_running") or ld.get("num_waiting")
                or ld.get("num_inflight_transfers") or ld["num_free_pages"] != ld["num_total_pages"]}
        if not open_on and counters == (0, 0, 0.0, 0.0) and not busy:
            break
        if time.monotonic() > deadline:
            if open_on or counters != (0, 0, 0.0, 0.0):
                report.violate(f"gateway in-flight counters not back to zero: active/queued/metric active/metric "
                               f"queued {counters}, open per worker {open_on}")
            for name, ld in busy.items():
                report.violate(f"{name} not idle: {ld}")
            break
        await asyncio.sleep(0.2)
    report.pages_leaked = {name: ld["num_total_pages"] - ld["num_free_pages"] for name, ld in loads.items()}
    report.migrations = metrics.get("pd_gateway_migrations_total", 0.0)
    report.retries = metrics.get("pd_gateway_retries_total", 0.0)


def _judge(run: ChaosRun) -> None:
    report, config = run.report, run.config
    for result, what in ((Result.HUNG, "hung past their deadline"), (Result.UNCLEAR, "ended without a clear error"),
                         (Result.WRONG, "completed with wrong text, id or usage")):
        bad = [o for o in report.outcomes if o.result is result]
        if bad:
            report.violate(f"{len(bad)} requests {what}; first: {bad[0].kind}: {bad[0].detail}")
    failed = [o for o in report.outcomes if o.result is Result.STREAM_FAILED]
    if failed and config.max_migrations > 0:
        report.violate(f"{len(failed)} started streams failed although migration is on; first: {failed[0].detail}")
    if not report.count(Result.OK):
        report.violate("no request completed")
    if report.faults and not any(o.result is Result.OK and o.t_end > report.faults[-1].t_recovered
                                 for o in report.outcomes):
        report.violate("nothing completed after the last fault")
    gw = run.cluster.gateway
    if not gw.is_alive or gw.pid != run.cluster.gateway_pid or gw.num_starts != 1:
        report.violate("the gateway restarted or died")


async def run(config: ChaosConfig) -> Report:
    """One chaos run (see the module doc); every child is reaped before this returns."""
    t0 = time.monotonic()
    log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="chaos-"))
    chaos = ChaosRun(config, log_dir)
    report, cluster = chaos.report, chaos.cluster
    monitor: asyncio.Task[None] | None = None
    try:
        prompts = make_prompts(chaos.rng, config.num_prompts)
        reference = await asyncio.to_thread(Reference, prompts, 96, cluster.config.page_size)
        await cluster.start()
        chaos.load = load = Load(cluster.base_url, reference, prompts, chaos.rng, config.request_timeout_s)
        monitor = asyncio.create_task(chaos.monitor(), name="chaos-monitor")
        report.t_load_start = time.monotonic()
        load.start(config.concurrency)
        await _schedule(chaos, report.t_load_start + config.duration_s)
        report.t_load_end = time.monotonic()
        if report.faults:
            report.faults[-1].t_next = report.t_load_end
        await load.stop()
        report.outcomes = load.outcomes
        await _settle(chaos)
        _judge(chaos)
        report.tracebacks = count_tracebacks(cluster.children)
        mismatches = kv_mismatches(cluster.children)
        if mismatches:  # (a wrong answer's room, where the client saw only the text)
            report.violate(f"{len(mismatches)} rooms held KV not their prompt's; first: {mismatches[0]}")
    finally:
        if monitor is not None:
            if monitor.done() and monitor.exception() is not None:
                report.violate(f"the monitor crashed: {monitor.exception()!r}")
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
        if chaos.load is not None:
            await chaos.load.stop()
            report.outcomes = chaos.load.outcomes
        await cluster.aclose()
        cluster.close()
        report.reaped = cluster.is_reaped
        report.wall_s = time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="chaos", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration-s", type=float, default=50.0, help="load phase length (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer", default="tcp", choices=["tcp", "mooncake", "nixl", "shm"],
                   help="the KV backend; shm: tcp with the same-host shared-memory path on (the workers' default)")
    p.add_argument("--concurrency", type=int, default=12, help="closed-loop clients (default %(default)s)")
    p.add_argument("--faults", default=",".join(CI_FAULTS),
                   help=f"comma-separated, in order; 'all' = {','.join(ALL_FAULTS)} (default: %(default)s)")
    p.add_argument("--fault-every-s", type=float, default=None,
                   help="cycle the fault list at this pace until the run ends (default: the list once)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--max-migrations", type=int, default=2, help="the gateway's --max-migrations")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="a client's deadline per request")
    p.add_argument("--log-dir", type=Path, default=None, help="children's logs (default: a new temp directory)")
    args = p.parse_args(argv)
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the cluster is reaped in ``finally``, as on Ctrl-C
    faults = ALL_FAULTS if args.faults == "all" else tuple(f for f in args.faults.split(",") if f)
    try:
        config = ChaosConfig(duration_s=args.duration_s, seed=args.seed, transfer=args.transfer,
                             concurrency=args.concurrency, faults=faults, fault_every_s=args.fault_every_s,
                             num_prefill=args.prefill, num_decode=args.decode, max_migrations=args.max_migrations,
                             request_timeout_s=args.request_timeout_s, log_dir=args.log_dir)
    except ValueError as exc:
        p.error(str(exc))
    report = asyncio.run(run(config))
    print(summary(report), flush=True)
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
