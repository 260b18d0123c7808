"""Shared fixtures (the helpers live in ``pdtest`` so test modules can import them too)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pdtest import Procs, SimCluster, has_gpu, start_bootstrap, start_gateway, start_worker


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
def sim_cluster(procs: Procs) -> Iterator[Callable[..., SimCluster]]:
    """Factory: bootstrap + N prefill + M decode sim workers + gateway, all real processes.

    At teardown every worker still alive must have its KV pool back to full: no test may leak pages.
    """
    made: list[SimCluster] = []

    def make(num_prefill: int = 1, num_decode: int = 1, transfer: str = "tcp", worker_args: tuple[str, ...] = (),
             prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
             gateway_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> SimCluster:
        boot = start_bootstrap(procs)
        common = ("--engine", "sim", "--transfer", transfer, "--num-pages", "256", "--page-size", "4", *worker_args)
        prefills = [start_worker(procs, "prefill", *common, *prefill_args, bootstrap=boot, env=env)
                    for _ in range(num_prefill)]
        decodes = [start_worker(procs, "decode", *common, *decode_args, bootstrap=boot, env=env)
                   for _ in range(num_decode)]
        port = start_gateway(procs, "--prefill", *[w.url for w in prefills], "--decode", *[w.url for w in decodes],
                             *gateway_args)
        cluster = SimCluster(procs, boot, prefills, decodes, port)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.wait_pools_full(alive_only=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
