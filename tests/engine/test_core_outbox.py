"""The engine core's Outbox: the step loop never waits on the pipe; a parent that reads slowly gets the steps'
deltas merged into fewer messages, every token exactly once and in order, other messages in their posted order."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading

from service.engine.core_outbox import Outbox
from service.engine.request import RequestOutput

NUM_REQUESTS = 64
NUM_STEPS = 600  # ~3 kB per step's message: far beyond what a pipe buffers


def _output(rid: str, tokens: list[int], finish_reason: str | None) -> RequestOutput:
    return RequestOutput(rid, [1, 2], "", finish_reason, 0, len(tokens), tokens, None, None)


def _post_steps(outbox: Outbox, lists: dict[str, list[int]]) -> None:
    """NUM_STEPS steps: every request gets one token per step; the last step finishes them; a "failed" message
    of request r0 and a reply are posted in the middle."""
    for step in range(NUM_STEPS):
        outputs = []
        for rid, tokens in lists.items():
            tokens.append(step * 1000 + int(rid[1:]))
            outputs.append(_output(rid, tokens, "length" if step == NUM_STEPS - 1 else None))
        outbox.post_outputs(outputs, {"step": float(step)} if step % 100 == 0 else None)
        if step == NUM_STEPS // 2:
            outbox.post(("reply", 7, True, "between steps"))


def test_a_slow_reader_gets_every_token_once_in_order_in_fewer_messages():
    ours, theirs = mp.Pipe(duplex=True)
    outbox = Outbox(ours)
    lists = {f"r{i}": [] for i in range(NUM_REQUESTS)}
    poster = threading.Thread(target=_post_steps, args=(outbox, lists))
    poster.start()
    poster.join(60.0)
    assert not poster.is_alive(), "posting waited on the pipe nobody reads"
    got: dict[str, list[int]] = {rid: [] for rid in lists}
    finished, messages, reply_after = {}, 0, None
    while len(finished) < NUM_REQUESTS:
        kind, *rest = pickle.loads(theirs.recv_bytes())
        messages += 1
        if kind == "reply":
            reply_after = sum(map(len, got.values())) // NUM_REQUESTS  # steps delivered before the reply
            assert rest == [7, True, "between steps"]
            continue
        assert kind == "out"
        for rid, token_ids, text, finish_reason, logprobs, top, num_cached in rest[0]:
            assert rid not in finished
            got[rid].extend(token_ids)
            assert (text, logprobs, top, num_cached) == ("", None, None, 0)
            if finish_reason is not None:
                finished[rid] = finish_reason
    outbox.close()
    assert got == lists
    assert set(finished.values()) == {"length"}
    assert reply_after == NUM_STEPS // 2 + 1  # after exactly the steps posted before it
    assert messages < NUM_STEPS / 2  # the steps queued behind a full pipe left together
    assert not theirs.poll(0.1)


def test_failed_ends_the_request_bookkeeping_and_a_broken_pipe_is_reported():
    ours, theirs = mp.Pipe(duplex=True)
    outbox = Outbox(ours)
    tokens = [5, 6]
    outbox.post_outputs([_output("a", tokens, None)], None)
    outbox.post(("failed", "a", "boom"))
    again = [9]  # a new request reusing the id starts from its first token
    outbox.post_outputs([_output("a", again, None)], None)
    assert pickle.loads(theirs.recv_bytes())[1][0][1] == (5, 6)
    assert pickle.loads(theirs.recv_bytes()) == ("failed", "a", "boom")
    assert pickle.loads(theirs.recv_bytes())[1][0][1] == (9,)
    theirs.close()
    outbox.post_outputs([_output("b", [1], None)], None)
    outbox.close()
    assert isinstance(outbox.error, OSError)
