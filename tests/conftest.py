"""Root test configuration.

Without CUDA, Triton kernels run in Triton's interpreter. The variable must be set before anything
imports triton (transformers and torch may import it while other test modules are collected), so it
is set here, in the first conftest pytest loads.

The tests run tiny models, for which one intra-op thread per process is as fast as two, and far faster when
the cores are shared (another process, a Ray worker or a second test process): with two OpenMP threads every
parallel region waits for whichever thread was descheduled, and waiting threads spin. The variable is set
before torch is imported, so child processes (engine cores, TP ranks, Ray workers, CLIs) inherit it; a value
already set in the environment wins.

Ray starts its worker processes (Serve replicas, and the engine cores they start) 15 nice levels below the
process that started the cluster. In the tests those replicas are what a test waits on, with timeouts and latency
bounds, while a second xdist worker runs CPU-bound tests: `RAY_worker_niceness=0` keeps the replicas at the test
run's priority (set here so the `hybrid-serve serve` processes the tests start inherit it), and the xdist worker
that runs CPU-bound tests lowers its own (`pytest_runtest_setup` below).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest  # noqa: E402
import torch  # noqa: E402 - after OMP_NUM_THREADS, which torch reads when it starts

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch before this file

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests that start a Ray cluster or a `hybrid-serve serve` process (test ids start with these): under pytest-xdist
# (`make test` runs two workers) they are one unit of work, which one worker runs, so two Ray clusters never run at
# once and the package-scoped cluster of tests/deployments starts once.
RAY_TEST_PATHS = ("tests/deployments/", "tests/evals/test_endpoint_evals.py")
RAY_UNIT = "ray"
# How much lower the scheduling priority (nice) of an xdist worker is while it runs tests outside that unit than
# that of the run: those tests wait on servers (timeouts, latency bounds), the others only use CPU, so on a machine
# with few cores the servers go first and the CPU-bound tests take the time they leave.
CPU_TESTS_NICE_INCREMENT = 10


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with these units: the tests under RAY_TEST_PATHS together, every other test module
    on its own (its module fixtures are set up once). The Ray unit goes first (the longest in wall time, and its
    worker keeps the run's priority), then the largest modules. (xdist's own `xdist_group` marks do not reach its
    scheduler with this pytest: it renames items through an attribute pytest no longer reads.) Only for xdist's
    default `--dist load`; another --dist value gets xdist's own scheduler."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return RAY_UNIT if nodeid.startswith(RAY_TEST_PATHS) else nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            if RAY_UNIT in self.workqueue:
                self.workqueue.move_to_end(RAY_UNIT, last=False)
            super()._assign_work_unit(node)

    return RayUnitScheduling(config, log)


def pytest_runtest_setup(item) -> None:
    """An xdist worker lowers its priority (once: nice only goes up) before its first test outside the Ray unit;
    the processes it starts (engine cores, tensor-parallel ranks) inherit it. The worker that runs the Ray unit does
    so only after it, when its Ray cluster has stopped."""
    if "PYTEST_XDIST_WORKER" not in os.environ or item.nodeid.startswith(RAY_TEST_PATHS):
        return
    target = min(19, os.getpriority(os.PRIO_PROCESS, os.getppid()) + CPU_TESTS_NICE_INCREMENT)
    if os.getpriority(os.PRIO_PROCESS, 0) < target:
        os.setpriority(os.PRIO_PROCESS, 0, target)
