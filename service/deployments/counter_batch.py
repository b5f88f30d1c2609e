"""Counter increments summed in the process and handed to Ray's counters in batches (the ingress' per-request
counters): one Ray Serve counter `inc` costs tens of microseconds of Python (tag merging and checks), which per
request adds up."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

COUNTER_FLUSH_S = 0.25  # an increment reaches Ray's counter at most this much later


class CounterBatch:
    """Increments summed per (metric, labels) and handed to the Ray counters in `live` once per COUNTER_FLUSH_S.
    Used from one event loop (its timer flushes); an increment made outside a running loop goes to Ray at once.
    What is pending when the process ends is lost (at most COUNTER_FLUSH_S of counts)."""

    def __init__(self, live: Mapping[str, Any]):
        self._live = live
        self._pending: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def inc(self, name: str, value: float, labels: tuple[tuple[str, str], ...] = ()) -> None:
        key = (name, labels)
        self._pending[key] = self._pending.get(key, 0) + value
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(COUNTER_FLUSH_S, self.flush)

    def flush(self) -> None:
        self._timer = None
        pending, self._pending = self._pending, {}
        for (name, labels), value in pending.items():
            if value > 0:  # Ray refuses an increment of 0
                self._live[name].inc(value, tags=dict(labels) or None)
