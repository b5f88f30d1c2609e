"""Triton kernel variants loaded after start-up, named in the log (the engine core watches once its engine is built).

A kernel variant (one specialization of a `@triton.jit` function) that a process has not loaded yet is compiled, or
read from Triton's disk cache, inside the step that first launches it: up to about a second for a real compile.
After the start-up warm-up (service/engine/warmup.py) that should not happen; when it does, the variant is a step
shape the warm-up did not make, and the log line names it (kernel and argument specialization) so the warm-up can
be taught it. Triton calls `knobs.runtime.jit_post_compile_hook` after every variant it adds to a process' cache."""

from __future__ import annotations

import logging
from typing import Any

import triton

log = logging.getLogger("hybrid_serve.engine")

MAX_REPR_CHARS = 400  # of a variant's description in the log


class CompileWatch:
    """Counts the kernel variants loaded from now on and logs each; `take()` returns those since the last call."""

    def __init__(self) -> None:
        self.runtime = triton.knobs.runtime
        if not hasattr(self.runtime, "jit_post_compile_hook"):
            raise RuntimeError(f"Triton {triton.__version__} has no knobs.runtime.jit_post_compile_hook")
        self.num_compiles = 0  # variants loaded since the watch started
        self._recent: list[str] = []  # their kernel names since the last take()
        self._previous = self.runtime.jit_post_compile_hook
        self.runtime.jit_post_compile_hook = self._on_compile

    def _on_compile(self, **hook_args: Any) -> None:
        """Triton's JITHook: keyword arguments key, repr (kernel and specialization), fn (.name), compile, ..."""
        self.num_compiles += 1
        self._recent.append(hook_args["fn"].name)
        log.warning(
            "kernel variant loaded after start-up (a step shape the warm-up missed): %s",
            hook_args["repr"][:MAX_REPR_CHARS],
        )

    def take(self) -> list[str]:
        out, self._recent = self._recent, []
        return out

    def close(self) -> None:
        self.runtime.jit_post_compile_hook = self._previous
