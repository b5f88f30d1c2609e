"""The stream of one request between an engine's producer thread and the request's event loop (shared by
`AsyncEngine` and `EngineProcess`).

`DeltaTracker` turns an engine step's cumulative `RequestOutput`s into `Delta`s (what each adds to what was sent);
`OutputStream.apply` accumulates them on the producer thread and says when the reader is due; `wake_all` (scheduled on
the reader's event loop, once per step and loop) wakes them; `OutputStream.take` hands the reader the newest cumulative
output, pacing a running stream to one output per `min_interval_s()`. Only the newest output is kept, so a reader that
falls behind costs one wake-up per output it reads, not one per engine step."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from service.engine.request import RequestOutput
from service.engine.tokenizer import IncrementalDetokenizer

# one request's progress in one step: (request_id, new token ids, new text, finish_reason | None,
# new logprobs | None, new top logprobs | None, num_cached_tokens). A plain tuple: a NamedTuple or dataclass
# per request per step costs about 4x as much to pickle and unpickle.
Delta = tuple[str, tuple[int, ...], str, "str | None", "tuple[float, ...] | None", "tuple[dict, ...] | None", int]


class DeltaTracker:
    """What each request's outputs add to what was already taken (the producer thread's bookkeeping)."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, str]] = {}  # request_id -> (tokens sent, text sent) of unfinished requests

    def delta(self, out: RequestOutput) -> Delta:
        """What `out` adds to what was already sent for its request (a finished request is forgotten)."""
        rid = out.request_id
        num_sent, text_sent = self.sent.get(rid, (0, ""))
        text = out.text[len(text_sent) :] if out.text.startswith(text_sent) else ""
        token_ids, logprobs, top = out.tokens_since(num_sent)
        if out.finished:
            self.sent.pop(rid, None)
        else:  # out.text == text_sent + text whenever text is not empty
            self.sent[rid] = (out.num_output_tokens, out.text if text else text_sent)
        return rid, token_ids, text, out.finish_reason, logprobs, top, out.num_cached_tokens

    def forget(self, rid: str) -> None:
        self.sent.pop(rid, None)


class OutputStream:
    """One request's output so far. A producer thread (the engine thread, or the reader of the engine core's
    messages) appends deltas (under `lock`); the request's event loop reads the newest cumulative output when woken
    (`take`)."""

    __slots__ = ("loop", "request_id", "prompt", "tokens", "logprobs", "top", "text", "finish_reason",
                 "num_cached", "error", "wake_at", "signalled", "ready", "lock", "detok", "detok_text",
                 "num_detok")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_id: str,
        prompt: list[int],
        detok: IncrementalDetokenizer | None,
    ):
        self.loop, self.request_id, self.prompt = loop, request_id, prompt
        self.detok = detok  # None: the child's text is used (stop strings, or no tokenizer)
        self.detok_text = ""  # text of tokens[:num_detok] (event loop only)
        self.num_detok = 0
        self.tokens: list[int] = []  # append-only: outputs share it and read their own prefix
        self.logprobs: list[float] | None = None
        self.top: list[dict[int, float]] | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.num_cached = 0
        self.error: BaseException | None = None
        self.wake_at = 0.0  # time.monotonic() before which a running output does not wake the reader
        self.signalled = False  # a wake-up is scheduled or pending: do not schedule another
        self.ready = asyncio.Event()
        self.lock = threading.Lock()

    def apply(self, delta: Delta) -> bool:
        """Producer thread: adds one step's progress; True if the reader should be woken now (`wake_all`)."""
        _, token_ids, text, finish_reason, logprobs, top, num_cached = delta
        with self.lock:
            self.tokens.extend(token_ids)
            if logprobs is not None:
                (self.logprobs if self.logprobs is not None else self._new_logprobs()).extend(logprobs)
            if top is not None:
                (self.top if self.top is not None else self._new_top()).extend(top)
            self.text += text
            self.finish_reason = finish_reason
            self.num_cached = num_cached
            return self._due()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = error

    def _new_logprobs(self) -> list[float]:
        self.logprobs = []
        return self.logprobs

    def _new_top(self) -> list[dict[int, float]]:
        self.top = []
        return self.top

    def _due(self) -> bool:
        if self.signalled:
            return False
        if self.finish_reason is not None or time.monotonic() >= self.wake_at:
            self.signalled = True
            return True
        return False

    async def take(self, min_interval_s: Callable[[], float] | None) -> RequestOutput | BaseException:
        """The newest output (or the error); the next running output wakes the reader min_interval_s() later."""
        interval = 0.0 if min_interval_s is None else min_interval_s()
        while True:
            await self.ready.wait()
            self.ready.clear()
            with self.lock:
                self.signalled = False
                if self.error is not None:
                    return self.error
                if not self.tokens and self.finish_reason is None:
                    continue
                self.wake_at = time.monotonic() + interval
                n, finish_reason, text, num_cached = len(self.tokens), self.finish_reason, self.text, self.num_cached
            if self.detok is not None:
                self.detok_text += self.detok.add_many(self.tokens[self.num_detok : n])
                self.num_detok, text = n, self.detok_text
            return self._output(n, finish_reason, text, num_cached)

    def _output(self, n: int, finish_reason: str | None, text: str, num_cached: int) -> RequestOutput:
        """The output after the first n tokens (the lists are append-only: the output reads its prefix)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt,
            text=text,
            finish_reason=finish_reason,
            num_cached_tokens=num_cached,
            num_output_tokens=n,
            output_token_ids=self.tokens,
            output_logprobs=self.logprobs,
            output_top_logprobs=self.top,
        )


def wake_all(streams: list[OutputStream]) -> None:
    """On the streams' event loop: wakes each stream's reader."""
    for stream in streams:
        stream.ready.set()


def wake_loops(due: dict[asyncio.AbstractEventLoop, list[OutputStream]]) -> None:
    """From the producer thread: one wake-up per event loop for the streams that are due there."""
    for loop, streams in due.items():
        try:
            loop.call_soon_threadsafe(wake_all, streams)
        except RuntimeError:  # that event loop is closed: nobody is waiting there any more
            pass
