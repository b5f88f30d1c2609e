"""Helpers for the tensor-parallel engine tests: the process table of this test process, mixed workloads."""

from __future__ import annotations

import os
import time

from tests.engine.helpers import random_ids


def child_pids(pid: int | None = None) -> set[int]:
    """Living (not zombie) direct children of pid (default: this process), from /proc."""
    pid = os.getpid() if pid is None else pid
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state != "Z":
            out.add(int(entry))
    return out


def alive(pid: int) -> bool:
    """pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout_s: float) -> set[int]:
    """Waits until none of pids is alive; returns those still alive after timeout_s."""
    deadline = time.monotonic() + timeout_s
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if alive(p)}
    return left


def mixed_prompts(vocab: int, seed: int, lens=(3, 21, 9, 5, 30, 13, 4, 17)) -> list[list[int]]:
    """Prompts of mixed lengths (longer than the test's chunk budget: chunked prefill)."""
    return [random_ids(n, seed + i, vocab) for i, n in enumerate(lens)]
