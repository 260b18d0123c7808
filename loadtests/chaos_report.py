"""The chaos runner's record of a run (``Report``: outcomes, faults, violations, end figures) and its summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from chaos_load import Outcome, Result

if TYPE_CHECKING:
    from chaos import ChaosConfig


@dataclass
class FaultRecord:
    name: str
    target: str
    t_inject: float
    t_recovered: float = 0.0
    t_next: float = 0.0
    migrations: float = 0.0
    recovered: bool = True


@dataclass
class Report:
    config: ChaosConfig
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    migrations: float = 0.0
    retries: float = 0.0
    pages_leaked: dict[str, int] = field(default_factory=dict)
    tracebacks: dict[str, int] = field(default_factory=dict)
    t_load_start: float = 0.0
    t_load_end: float = 0.0
    wall_s: float = 0.0
    log_dir: Path | None = None
    reaped: bool = False  # every child the run started has exited and been waited for

    @property
    def ok(self) -> bool:
        return not self.violations

    def count(self, *results: Result, kind: str | None = None) -> int:
        return sum(1 for o in self.outcomes if o.result in results and (kind is None or o.kind == kind))

    def violate(self, message: str) -> None:
        if message not in self.violations:
            self.violations.append(message)


def _rate(outcomes: list[Outcome], start: float, end: float) -> str:
    done = [o for o in outcomes if o.result is Result.OK and start <= o.t_end < end]
    span = max(end - start, 1e-9)
    return f"{len(done) / span:6.1f} req/s {sum(o.tokens for o in done) / span:7.0f} tok/s"


def summary(report: Report) -> str:
    c, t0 = report.config, report.t_load_start
    migration = f"on (max {c.max_migrations})" if c.max_migrations else "off"
    lines = [
        f"chaos: transfer={c.transfer} seed={c.seed} concurrency={c.concurrency} prefill={c.num_prefill} "
        f"decode={c.num_decode} migration {migration}; load {report.t_load_end - t0:.1f}s, wall {report.wall_s:.1f}s",
        f"requests: sent {len(report.outcomes)}  completed {report.count(Result.OK)}  "
        f"failed-with-clear-error {report.count(Result.CLEAR_ERROR, Result.STREAM_FAILED)} "
        f"(before start {report.count(Result.CLEAR_ERROR)}, started streams {report.count(Result.STREAM_FAILED)})  "
        f"hung {report.count(Result.HUNG)}  unclear {report.count(Result.UNCLEAR)}  "
        f"wrong {report.count(Result.WRONG)}  client-disconnects {report.count(Result.DISCONNECTED)}",
        f"faults injected: {len(report.faults)}   migrations: {report.migrations:g}   retries: {report.retries:g}   "
        f"pages leaked: {sum(report.pages_leaked.values())} "
        f"({', '.join(f'{k} {v}' for k, v in report.pages_leaked.items())})",
        f"throughput (completed requests): before faults {_rate(report.outcomes, t0, report.faults[0].t_inject)}"
        if report.faults else f"throughput: {_rate(report.outcomes, t0, report.t_load_end)}",
    ]
    for f in report.faults:
        lines.append(f"  {f.t_inject - t0:5.1f}s {f.name:<24} {f.target:<16} during {f.t_recovered - f.t_inject:4.1f}s "
                     f"{_rate(report.outcomes, f.t_inject, f.t_recovered)} | after "
                     f"{_rate(report.outcomes, f.t_recovered, f.t_next)} | migrations {f.migrations:g}"
                     + ("" if f.recovered else "  NOT RECOVERED"))
    errors = sorted({o.detail.split(":")[0] for o in report.outcomes if o.result is Result.CLEAR_ERROR})
    if errors:
        lines.append(f"clear errors seen: {', '.join(errors)}")
    noisy = {k: v for k, v in report.tracebacks.items() if v}
    if noisy:
        lines.append(f"tracebacks in logs: {noisy} (logs in {report.log_dir})")
    lines.append("invariants: OK" if report.ok else "invariants FAILED:\n" + "\n".join(f"  - {v}"
                                                                                     for v in report.violations))
    return "\n".join(lines)
