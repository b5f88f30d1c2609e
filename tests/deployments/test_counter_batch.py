"""CounterBatch: increments summed per (metric, labels), handed to the counters once per flush interval."""

import asyncio

from service.deployments import counter_batch
from service.deployments.counter_batch import CounterBatch


class _Counter:
    def __init__(self) -> None:
        self.calls: list[tuple[float, dict | None]] = []

    def inc(self, value: float, tags: dict | None = None) -> None:
        self.calls.append((value, tags))


def test_increments_are_summed_and_flushed_once_per_interval(monkeypatch):
    monkeypatch.setattr(counter_batch, "COUNTER_FLUSH_S", 0.01)
    live = {"a": _Counter(), "b": _Counter()}
    batch = CounterBatch(live)

    async def run() -> list:
        for _ in range(5):
            batch.inc("a", 1, (("key", "k1"), ("status", "200")))
        batch.inc("a", 2, (("key", "k2"), ("status", "200")))
        batch.inc("b", 7)
        batch.inc("b", 0, (("key", "k3"),))  # sums to 0: Ray refuses it, so it is not sent
        assert live["a"].calls == [] and live["b"].calls == []  # nothing before the flush
        await asyncio.sleep(0.05)
        first = (list(live["a"].calls), list(live["b"].calls))
        batch.inc("a", 1, (("key", "k1"), ("status", "200")))
        await asyncio.sleep(0.05)
        return [first, live["a"].calls[len(first[0]) :]]

    (a, b), later = asyncio.run(run())
    assert sorted(a, key=str) == sorted(
        [(5, {"key": "k1", "status": "200"}), (2, {"key": "k2", "status": "200"})], key=str
    )
    assert b == [(7, None)]
    assert later == [(1, {"key": "k1", "status": "200"})]


def test_outside_an_event_loop_an_increment_goes_at_once():
    live = {"a": _Counter()}
    CounterBatch(live).inc("a", 3, (("key", "k"),))
    assert live["a"].calls == [(3, {"key": "k"})]
