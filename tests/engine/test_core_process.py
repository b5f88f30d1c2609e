"""EngineProcess: the engine in a child process gives the in-process engine's streams; abort, bad input,
introspection, a dead child (streams fail, health fails, no orphans) and shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from service.deployments.pool_audit import audit_pools
from service.engine import EngineConfig, SamplingParams
from service.engine.async_engine import EngineDeadError
from service.engine.core_process import EngineProcess
from tests.engine.helpers import greedy, make_engine, random_ids


def _config(path: str) -> EngineConfig:
    return EngineConfig(model_path=path, device="cpu", page_size=4, mamba_cache_strategy="extra_buffer")


@pytest.fixture(scope="module")
def core(tiny_model_dir):
    """The tiny model (it has a tokenizer) in an engine core process."""
    engine = EngineProcess(_config(tiny_model_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """The same engine in this process: the oracle for what the child streams."""
    return make_engine(tiny_model_dir, mamba_cache_strategy="extra_buffer", debug_integrity=False)


async def _collect(engine, prompt, params, rid=None, **kw):
    return [out async for out in engine.generate(prompt, params, request_id=rid, **kw)]


def _alive(pid: int) -> bool:
    """pid exists and is not a zombie (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def test_streams_match_the_in_process_engine(core, ref):
    prompts = [random_ids(10 + i, i) for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True)

    async def main():
        return await asyncio.gather(*[_collect(core, p, params) for p in prompts])

    streams = asyncio.run(main())
    for outs, want in zip(streams, ref.generate(prompts, [params] * 4)):
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 8
        assert outs[-1].finish_reason == "length" and all(not o.finished for o in outs[:-1])
        assert outs[-1].token_ids == want.token_ids
        assert outs[-1].logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert [sorted(t) for t in outs[-1].top_logprobs] == [sorted(t) for t in want.top_logprobs]
        assert outs[-1].text == want.text
    assert not _torch_cuda_initialised()


def test_text_equals_the_in_process_engine_with_and_without_stop_strings(core, ref):
    """Text of requests without stop strings is detokenised in this process, with stop strings in the child:
    both equal the in-process engine's text, chunk by chunk as a prefix, and exactly at the end."""
    prompts = [random_ids(12, 20 + i, vocab=200) for i in range(3)]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    stop = ref.generate(prompts[:1], plain)[0].text[3:5]  # a stop string the greedy output contains
    assert len(stop) == 2
    cases = [(p, plain) for p in prompts] + [(prompts[0], dataclasses.replace(plain, stop=(stop,)))]
    want = ref.generate([p for p, _ in cases], [sp for _, sp in cases])
    streams = asyncio.run(_gather(core, cases))
    for outs, ref in zip(streams, want):
        assert all(ref.text.startswith(o.text) for o in outs)
        assert (outs[-1].text, outs[-1].token_ids, outs[-1].finish_reason) == (
            ref.text,
            ref.token_ids,
            ref.finish_reason,
        )
    assert want[-1].finish_reason == "stop" and stop not in want[-1].text


async def _gather(engine, cases):
    return await asyncio.gather(*[_collect(engine, p, sp) for p, sp in cases])


def _torch_cuda_initialised() -> bool:
    import torch

    return torch.cuda.is_initialized()


def test_abort_early_exit_and_pool_audit(core):
    async def main():
        stream = core.generate(random_ids(30, 1), greedy(200), request_id="a")
        first = await stream.__anext__()
        await stream.aclose()  # consumer goes away (client disconnect): the child aborts the request
        running = core.generate(random_ids(30, 2), greedy(1000), request_id="b")
        outs = [await running.__anext__()]  # b is running: abort it (its 1000 tokens take far longer)
        await core.abort("b")
        outs += [out async for out in running]
        await core.check_alive()
        return first, outs, await core.inspect(audit_pools)

    first, outs, audit = asyncio.run(main())
    assert first.finish_reason is None and outs[-1].finish_reason == "abort"
    assert audit["requests_in_engine"] == 0 and audit["live_slots_in_use"] == 0, audit
    assert audit["kv_page_refs_outside_cache"] == 0 and audit["integrity_error"] is None, audit
    stats = core.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0


class _CountingConn:
    """The parent's end of the pipe, counting the messages it sends (everything else passes through)."""

    def __init__(self, conn):
        self.conn, self.sent = conn, 0

    def send_bytes(self, payload):
        self.sent += 1
        return self.conn.send_bytes(payload)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_burst_is_one_message_and_a_request_cancelled_before_it_left_does_not_run(core, ref, monkeypatch):
    """Requests added in one pass of the event loop reach the child in one message and stream what the
    in-process engine gives; a request cancelled while still queued is aborted after its add, never left running."""
    prompts = [random_ids(6 + i, 40 + i) for i in range(12)]
    counting = _CountingConn(core._conn)
    monkeypatch.setattr(core, "_conn", counting)

    async def main():
        streams = await asyncio.gather(*[_collect(core, p, greedy(5)) for p in prompts])
        sent_for_burst = counting.sent
        queued = core.generate(random_ids(20, 9), greedy(10_000), request_id="queued")
        first = asyncio.ensure_future(queued.__anext__())
        await asyncio.sleep(0)  # the request is queued; its message has not left yet
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await core.check_alive()  # a round trip: the child has handled the add and the abort before it
        return streams, sent_for_burst, await core.inspect(audit_pools)

    streams, sent_for_burst, audit = asyncio.run(main())
    assert sent_for_burst == 1
    for outs, want in zip(streams, ref.generate(prompts, [greedy(5)] * len(prompts))):
        assert outs[-1].token_ids == want.token_ids and outs[-1].finish_reason == "length"
    assert audit["requests_in_engine"] == 0 and audit["live_slots_in_use"] == 0, audit


def test_bad_prompt_duplicate_id_and_unpicklable_inspect_are_refused(core):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await _collect(core, [], greedy(4))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(core, [10**9], greedy(4))
        with pytest.raises(Exception, match="pickle"):  # inspect needs a module-level function
            await core.inspect(lambda engine: engine.stats())
        await core.check_alive()
        first = asyncio.create_task(_collect(core, random_ids(10, 4), greedy(40), rid="dup"))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="already in use"):
            await _collect(core, random_ids(10, 5), greedy(3), rid="dup")
        return await first, await _collect(core, random_ids(5, 3), greedy(3))

    first, after = asyncio.run(main())
    assert len(first[-1].token_ids) == 40 and len(after[-1].token_ids) == 3


def test_captured_states_cross_the_boundary_on_the_cpu(core):
    async def main():
        rid = "cap"
        await _collect(core, random_ids(20, 7), greedy(1), rid=rid, bypass_cache=True, capture_states=True)
        return await core.pop_captured_states(rid)

    states = asyncio.run(main())
    assert states["prompt"].num_tokens == 20 and states["prompt"].ssm.device.type == "cpu"


def test_dead_child_fails_streams_and_health_and_leaves_no_process(tiny_model_dir):
    engine = EngineProcess(_config(tiny_model_dir))
    pid = engine.pid

    async def main():
        task = asyncio.create_task(_collect(engine, random_ids(20, 1), greedy(10_000)))
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            await asyncio.wait_for(task, 20)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.check_alive(), 5)
        with pytest.raises(EngineDeadError):
            await _collect(engine, random_ids(5, 1), greedy(2))
        await engine.shutdown(drain_timeout_s=1)

    asyncio.run(main())
    assert _wait_gone(pid)


def test_shutdown_ends_the_child(tiny_model_dir):
    engine = EngineProcess(_config(tiny_model_dir))
    pid = engine.pid
    assert _alive(pid)

    async def main():
        out = await _collect(engine, random_ids(5, 2), greedy(3))
        await engine.shutdown(drain_timeout_s=5)
        return out

    assert len(asyncio.run(main())[-1].token_ids) == 3
    assert _wait_gone(pid, 5)


_PARENT = """
import sys, time
from service.engine import EngineConfig
from service.engine.core_process import EngineProcess
e = EngineProcess(EngineConfig(model_path=sys.argv[1], device="cpu", page_size=4))
print(e.pid, flush=True)
time.sleep(600)
"""


def test_child_exits_when_its_parent_is_killed(tiny_model_dir):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, tiny_model_dir], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        assert _wait_gone(child, 10), f"engine core {child} outlived its parent"
    finally:
        parent.kill()
