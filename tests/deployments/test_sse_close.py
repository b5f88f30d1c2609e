"""The ingress's streaming response closes its body when the client goes away while a chunk is being sent, so
the body's `finally` (which cancels the engine calls) runs at once, not when the generator is collected."""

import asyncio

import pytest
from fastapi.responses import StreamingResponse

from service.deployments.sse import ClosingStreamingResponse


async def _cancel_while_sending(response_cls: type[StreamingResponse], spec_version: str) -> bool:
    """Whether the body's finally has run right after the response task was cancelled inside `send`."""
    cleaned_up = asyncio.Event()
    blocked_in_send = asyncio.Event()

    async def body():
        try:
            while True:
                yield "data: x\n\n"
        finally:
            cleaned_up.set()

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            blocked_in_send.set()
            await asyncio.Event().wait()  # a client that reads nothing more

    async def receive() -> dict:
        await asyncio.Event().wait()  # no disconnect message: the cancel comes from outside (Serve's proxy)
        return {"type": "http.disconnect"}

    response = response_cls(body(), media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    task = asyncio.create_task(response(scope, receive, send))
    await asyncio.wait_for(blocked_in_send.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return cleaned_up.is_set()  # `response` still holds the body: garbage collection cannot have closed it


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_cancel_during_send_closes_the_body_at_once(spec_version):
    assert asyncio.run(_cancel_while_sending(ClosingStreamingResponse, spec_version))


def test_starlettes_response_leaves_the_body_open():
    """The failure the class exists for: with Starlette's own response the cleanup has not run."""
    assert not asyncio.run(_cancel_while_sending(StreamingResponse, "2.4"))
