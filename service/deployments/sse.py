"""The streaming response of the ingress: a `StreamingResponse` that closes its body when the response ends.

Starlette leaves the body generator suspended at its `yield` when the response is cancelled while a chunk is
being sent (the client went away): the generator's `finally` (which cancels the engine calls, so the engine
aborts the request and frees its pages and slot) would then run only when the generator is garbage-collected,
seconds or minutes later if an exception's traceback holds it in a reference cycle. Closing it in the response's
own `finally` runs that cleanup at once, whatever ended the response.
"""

from __future__ import annotations

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """`StreamingResponse` whose body (an async generator) is closed when the response ends, also when cancelled.
    A body that nests generators must close the inner ones itself (`contextlib.aclosing`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
