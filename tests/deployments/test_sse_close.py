"""The ingress's streaming response (service/deployments/sse.py): it closes its body when the response task is
cancelled while a chunk is being sent (so the body's `finally`, which cancels the engine calls, runs at once, not
when the generator is collected), cancels the body when the client disconnects, and ends the body with the event
that ends with [DONE], reading the body to its end."""

import asyncio
from collections.abc import Callable

import pytest
from fastapi.responses import StreamingResponse

from service.deployments.sse import SSEResponse


def _sse(body):
    return SSEResponse(body)


def _starlette(body):
    return StreamingResponse(body, media_type="text/event-stream")


async def _cancel_while_sending(make_response: Callable, spec_version: str) -> bool:
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

    response = make_response(body())
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    task = asyncio.create_task(response(scope, receive, send))
    await asyncio.wait_for(blocked_in_send.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return cleaned_up.is_set()  # `response` still holds the body: garbage collection cannot have closed it


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_cancel_during_send_closes_the_body_at_once(spec_version):
    assert asyncio.run(_cancel_while_sending(_sse, spec_version))


def test_starlettes_response_leaves_the_body_open():
    """The failure the class exists for: with Starlette's own response the cleanup has not run."""
    assert not asyncio.run(_cancel_while_sending(_starlette, "2.4"))


async def _disconnect_mid_stream() -> tuple[bool, list[dict]]:
    """A body that waits forever after its first event; the client disconnects after reading that event."""
    cancelled, sent = asyncio.Event(), []
    disconnect = asyncio.Event()

    async def body():
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()  # the engine has nothing more yet
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            disconnect.set()

    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    await asyncio.wait_for(SSEResponse(body())({"type": "http"}, receive, send), 5)  # returns, does not raise
    return cancelled.is_set(), sent


def test_client_disconnect_cancels_the_body_and_ends_the_response():
    cancelled, sent = asyncio.run(_disconnect_mid_stream())
    assert cancelled
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]


async def _stream_to_done() -> tuple[list[dict], bool]:
    read_to_end = False

    async def body():
        nonlocal read_to_end
        yield "data: 1\n\n"
        yield "data: 2\n\ndata: [DONE]\n\n"
        yield "data: late\n\n"  # after [DONE]: not sent
        read_to_end = True

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    await asyncio.wait_for(SSEResponse(body())({"type": "http"}, receive, send), 5)
    return sent, read_to_end


def test_the_done_event_ends_the_body_in_one_send():
    sent, read_to_end = asyncio.run(_stream_to_done())
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    assert bodies == [(b"data: 1\n\n", True), (b"data: 2\n\ndata: [DONE]\n\n", False)]
    assert read_to_end
