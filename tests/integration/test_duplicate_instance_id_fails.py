"""Two prefills given one ``--instance-id``: the registry refuses the second (409 ``instance_conflict``) while the
first renews its lease. The second must then fail its start-up naming ``--instance-id`` (docs/bootstrap.md), not
wait for ever: since a prefill started before its registry waits for it without limit (``--registry-wait-s 0``),
a conflict that never ends left the second worker "starting" for good (its /liveness 200, its native port closed),
with only a warning every 10 s. A restarted prefill's conflict with its dead predecessor ends within the
registry's 5 s conflict window, so a conflict that lasts longer is another live process."""

from __future__ import annotations

import subprocess

from pdtest import Procs, free_port, start_bootstrap, start_worker


def test_a_second_prefill_with_the_same_instance_id_exits_naming_the_flag(procs: Procs) -> None:
    registry = start_bootstrap(procs)
    first = start_worker(procs, "prefill", "--engine", "sim", "--num-pages", "32", "--page-size", "4",
                         "--instance-id", "prefill-dup", bootstrap=registry)
    second = procs.start("second", "-m", "workers.cli", "--role", "prefill", "--engine", "sim", "--num-pages", "32",
                         "--page-size", "4", "--port", str(free_port()), "--http-port", str(free_port()),
                         "--instance-id", "prefill-dup", "--bootstrap", registry, "--log-level", "warning")
    try:
        code = second.wait(45)
    except subprocess.TimeoutExpired:
        code = None
    log = procs.log("second")
    assert code not in (None, 0), f"the second prefill still waits (exit {code}):\n{log}"
    assert "--instance-id" in log, log
    assert first.proc.poll() is None
    assert first.get("/health") == {"status": "ok", "role": "prefill"}
