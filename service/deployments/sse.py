"""The streaming response of the ingress: a plain ASGI response that writes an async iterator of SSE text.

It does what Starlette's `StreamingResponse` does for the ingress at less cost per request and per event: no anyio
task group (one asyncio task watches for the client's disconnect), and the event that ends with `data: [DONE]` leaves
in the same `send` as the end of the body. What it keeps:

- a client that goes away cancels the body's iteration at once (the watcher cancels the response's task; the
  body's `finally` cancels the engine calls, so the engine aborts the request and frees its pages and slot);
- the body is closed in the response's own `finally`, whatever ended the response (Starlette leaves it suspended
  at its `yield` when the response is cancelled inside `send`, and its cleanup would then wait for the garbage
  collector);
- after the last event has left, the body is read to its end (so the engine calls end normally, not cancelled).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Receive, Scope, Send

from service.openai.responses import SSE_DONE

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class SSEResponse:
    """ASGI response streaming `body` (str events). A body that nests generators must close the inner ones itself
    (`contextlib.aclosing`)."""

    def __init__(self, body: AsyncIterator[str], status_code: int = 200):
        self.body_iterator = body
        self.status_code = status_code
        self._complete = False  # the end of the body has been sent: a disconnect no longer cancels anything
        self._client_gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(self._watch(receive, task))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": SSE_HEADERS})
            async for text in self.body_iterator:
                if self._complete:  # after the last event: read to the end, send nothing
                    continue
                last = text.endswith(SSE_DONE)
                self._complete = last
                await send({"type": "http.response.body", "body": text.encode(), "more_body": not last})
            if not self._complete:
                self._complete = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self._client_gone:
                raise
            task.uncancel()  # the watcher's cancel: the client left, the response ends normally
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]

    async def _watch(self, receive: Receive, task: asyncio.Task) -> None:
        """Cancels the response's task when the client disconnects before the end of the body was sent."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._complete:
            self._client_gone = True
            task.cancel()
