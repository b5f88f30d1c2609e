"""`hybrid-serve serve` as a user runs it: it joins the session's Ray cluster (RAY_ADDRESS), deploys the app,
prints how to call it, answers `curl` on /v1/chat/completions, and on Ctrl-C drains the request in flight,
removes its app and exits; the replica's processes (its engine core included) end with it."""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
from ray import serve

from service.deployments.serve_cli import APP_NAME
from tests.deployments.serve_testkit import free_port, process_alive, replica_stats, wait_until


def _lines(proc: subprocess.Popen) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [out.put(line) for line in proc.stdout], daemon=True).start()
    return out


def _wait_for_line(lines: queue.Queue[str], needle: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no line containing {needle!r} within {timeout_s}s; got:\n{''.join(seen)}") from None
        seen.append(line)
        if needle in line:
            return seen


def test_access_log_flag_reaches_both_deployments():
    """Serve's per-call access log lines are off unless `--access-log` asks for them, on the ingress and the engine."""
    from service.cli import build_parser
    from service.deployments.app import engine_deployment_options, ingress_deployment_options
    from service.deployments.args import AppArgs
    from service.deployments.serve_cli import app_args_from_cli

    def options(*flags: str) -> list[dict]:
        ns = build_parser().parse_args(["serve", "--model-path", "m", "--device", "cpu", *flags])
        args = AppArgs.model_validate(app_args_from_cli(ns))
        return [engine_deployment_options(args)["logging_config"], ingress_deployment_options(args)["logging_config"]]

    assert options() == [{"enable_access_log": False}] * 2
    assert options("--access-log") == [{"enable_access_log": True}] * 2
    assert options("--no-access-log") == [{"enable_access_log": False}] * 2


def test_max_ongoing_requests_flag_sets_the_engine_bound_and_the_ingress_admission():
    """`--max-ongoing-requests` is the engine replica's Serve bound; its handle-side queue and what the ingress
    admits scale with it (default 256)."""
    from service.cli import build_parser
    from service.deployments.app import engine_deployment_options, ingress_deployment_options
    from service.deployments.args import QUEUED_REQUESTS_PER_REPLICA, AppArgs
    from service.deployments.serve_cli import app_args_from_cli

    def options(*flags: str) -> tuple[dict, dict]:
        ns = build_parser().parse_args(["serve", "--model-path", "m", "--device", "cpu", *flags])
        args = AppArgs.model_validate(app_args_from_cli(ns))
        return engine_deployment_options(args), ingress_deployment_options(args)

    (engine, ingress), (engine2, ingress2) = options(), options("--max-ongoing-requests", "512")
    assert engine["max_ongoing_requests"] == 256 and engine2["max_ongoing_requests"] == 512
    assert engine2["max_queued_requests"] == QUEUED_REQUESTS_PER_REPLICA * 512
    assert ingress2["max_ongoing_requests"] == 2 * ingress["max_ongoing_requests"]


DRAIN_TOKENS = 800
N = 40  # tokens of the streamed completion in the high-throughput test


def _long_stream(port: int, started: threading.Event, usage: dict) -> None:
    body = {
        "model": "tiny",
        "prompt": "Count:",
        "max_tokens": DRAIN_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=90) as resp:
        for line in resp.iter_lines():
            started.set()
            if line.startswith("data: {") and '"usage"' in line:
                usage.update(json.loads(line[6:])["usage"] or {})


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary")
def test_serve_cli_answers_curl_and_stops_on_ctrl_c(cluster, tiny_model_path):
    exe = Path(sys.executable).parent / "hybrid-serve"
    proc = subprocess.Popen(
        [
            str(exe),
            "serve",
            "--model-path",
            tiny_model_path,
            "--replicas",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(cluster.http_port),
            "--reasoning-parser",
            "nemotron_3",
            "--tool-call-parser",
            "qwen3_coder",
        ],
        env={**os.environ, "RAY_ADDRESS": cluster.gcs_address},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        printed = "".join(_wait_for_line(_lines(proc), "Press Ctrl-C", timeout_s=120))
        assert f"http://127.0.0.1:{cluster.http_port}/v1" in printed and "curl" in printed
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
        curl = subprocess.run(
            [
                "curl",
                "-sS",
                "--max-time",
                "60",
                f"http://127.0.0.1:{cluster.http_port}/v1/chat/completions",
                "-H",
                "Content-Type: application/json",
                "-d",
                json.dumps(body),
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
        answer = json.loads(curl.stdout)
        assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] >= 1, curl.stdout

        replica = next(iter(replica_stats(APP_NAME, 1).values()))
        started, usage = threading.Event(), {}
        in_flight = threading.Thread(target=_long_stream, args=(cluster.http_port, started, usage), daemon=True)
        in_flight.start()
        assert started.wait(timeout=60)
        proc.send_signal(signal.SIGINT)  # Ctrl-C while a request streams: it must finish (drain)
        in_flight.join(timeout=90)
        assert usage.get("completion_tokens") == DRAIN_TOKENS, usage
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_until(lambda: APP_NAME not in serve.status().applications, timeout_s=30, what="the CLI's app to be removed")
    for pid in (replica["replica_pid"], replica["engine_core_pid"]):  # no process of the replica outlives it
        wait_until(
            lambda pid=pid: not process_alive(pid), timeout_s=60, what=f"process {pid} of the removed replica to end"
        )


def _listener_pids(port: int) -> set[int]:
    """Pids holding a listening TCP socket on 127.0.0.1:port or *:port (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # state 0A: LISTEN
                    inodes.add(cols[9])
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:  # gone, or not ours to read
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            pids.add(int(pid))
    return pids


def _niceness(pid: int) -> int | None:
    """The process' nice value (from /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])
    except OSError:
        return None


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(pid))
        except OSError:
            continue
    out, todo = set(), [root]
    while todo:
        out.add(pid := todo.pop())
        todo.extend(children.get(pid, ()))
    return out


def _listen_addresses(pids: set[int], ports: range) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses of the listening TCP sockets on `ports` that the processes `pids` hold (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            inodes |= {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:  # gone, or not ours to read
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                addr, port = cols[1].rsplit(":", 1)
                if cols[3] != "0A" or int(port, 16) not in ports or f"socket:[{cols[9]}]" not in inodes:
                    continue
                raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append(ipaddress.ip_address(raw))
    return out


def test_serve_cli_high_throughput_mode_streams_exactly_through_haproxy(tiny_model_path):
    """The default data path of a server this command starts itself: HAProxy answers the HTTP port and forwards to
    the ingress replicas' own HTTP servers; a streamed completion of N tokens still arrives once, in order, in at
    most N chunks, with the right usage and finish reason. Ray's workers (replicas, engine cores) run at the
    command's priority."""
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="hst", dir="/tmp")  # short: Ray's socket paths live below it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_worker_niceness")}  # the CLI's own
    env.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(Path(sys.executable).parent / "hybrid-serve"), "serve", "--model-path", tiny_model_path]
    cmd += ["--port", str(port), "--metrics-port", str(free_port()), "--ingress-replicas", "2"]
    cmd += ["--stream-chunks-per-s", "8"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_line(_lines(proc), "Press Ctrl-C", timeout_s=240)
        listeners = _listener_pids(port)
        assert listeners and all(Path(f"/proc/{p}/exe").resolve().name == "haproxy" for p in listeners), listeners
        # the ingress replicas' own HTTP servers (Ray's direct-ingress ports, 30000 up) bind --host (127.0.0.1 here)
        direct = _listen_addresses(_descendants(proc.pid), range(30000, 31000))
        assert len(direct) >= 2 and all(a.is_loopback for a in direct), direct
        # HAProxy's stats page and exporter are on ports picked per server, not Ray's fixed 8404 / 9101 (a second
        # local server could not start its HAProxy)
        assert not _listen_addresses(listeners, range(8404, 8405)) and not _listen_addresses(
            listeners, range(9101, 9102)
        )
        body = {
            "model": "tiny",
            "prompt": "The robot counts",
            "max_tokens": N,
            "ignore_eos": True,
            "logprobs": 0,
            "seed": 7,
        }
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=120) as client:
            full = client.post("/completions", json=body).json()
            stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", "/completions", json=stream_body) as resp:
                assert resp.status_code == 200
                lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == N == full["usage"]["completion_tokens"]
        assert usage["prompt_tokens"] == full["usage"]["prompt_tokens"]
        choices = [c["choices"][0] for c in chunks[:-1]]
        assert 1 <= len(choices) < N and [c.get("finish_reason") for c in choices][-1] == "length"
        streamed = [t for c in choices for t in c["logprobs"]["tokens"]]
        assert len(streamed) == N and streamed == full["choices"][0]["logprobs"]["tokens"]
        assert "".join(c["text"] for c in choices) == full["choices"][0]["text"]
        # every process of the server (Ray's workers: the replicas, their engine cores, HAProxy) at the CLI's priority
        nice = {pid: _niceness(pid) for pid in _descendants(proc.pid)}
        assert len(nice) > 5 and set(nice.values()) - {None} == {_niceness(proc.pid)}, nice
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
