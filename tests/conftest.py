"""Root test configuration.

Without CUDA, Triton kernels run in Triton's interpreter. The variable must be set before anything
imports triton (transformers and torch may import it while other test modules are collected), so it
is set here, in the first conftest pytest loads.

The tests run tiny models, for which one intra-op thread per process is as fast as two, and far faster when
the cores are shared (another process, a Ray worker or a second test process): with two OpenMP threads every
parallel region waits for whichever thread was descheduled, and waiting threads spin. The variable is set
before torch is imported, so child processes (engine cores, TP ranks, Ray workers, CLIs) inherit it; a value
already set in the environment wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402 - after OMP_NUM_THREADS, which torch reads when it starts

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch before this file

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests that start a Ray cluster or a `hybrid-serve serve` process: under pytest-xdist (`make test` runs two workers)
# they form one group that one worker runs, so two Ray clusters never run at once and the package-scoped cluster of
# tests/deployments starts once.
RAY_TEST_PATHS = ("tests/deployments/", "tests/evals/test_endpoint_evals.py")
# How much lower the scheduling priority (nice) of an xdist worker is while it runs tests outside the `ray` group
# than that of the run: the tests of the group wait on servers (timeouts, latency bounds), the others only use CPU,
# so on a machine with few cores the servers go first and the CPU-bound tests take the time they leave.
CPU_TESTS_NICE_INCREMENT = 10


def pytest_collection_modifyitems(config, items) -> None:
    root = str(config.rootpath)
    for item in items:
        rel = os.path.relpath(str(item.path), root)
        if rel.startswith(RAY_TEST_PATHS):
            item.add_marker(pytest.mark.xdist_group("ray"))


def pytest_runtest_setup(item) -> None:
    """An xdist worker lowers its priority (once: nice only goes up) before its first test outside the `ray` group;
    the processes it starts (engine cores, tensor-parallel ranks) inherit it. The worker that runs the group does
    so only after the group, when its Ray cluster has stopped."""
    if "PYTEST_XDIST_WORKER" not in os.environ or item.get_closest_marker("xdist_group") is not None:
        return
    target = min(19, os.getpriority(os.PRIO_PROCESS, os.getppid()) + CPU_TESTS_NICE_INCREMENT)
    if os.getpriority(os.PRIO_PROCESS, 0) < target:
        os.setpriority(os.PRIO_PROCESS, 0, target)
