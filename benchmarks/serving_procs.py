"""The server process of `serving_bench`: `hybrid-serve serve` in its own local Ray cluster, its process tree,
and host CPU time per process role read from /proc (Linux; no psutil needed)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
STOP_WAIT_S = 20.0  # after Ctrl-C the server gets this long to stop; then its whole tree is killed
METRICS_REPORT_MS = 500  # how often the server's processes report metrics to Ray's agent (Ray's default: 10 s)
# Prometheus text sample: name, {labels} (optional), value
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
# process title (Ray sets `ray::<actor>`) -> role in the report; first match wins
_ROLES = (
    (":engine", "engine replica"),
    (":openai", "ingress"),
    ("ray::ProxyActor", "proxy"),
    ("haproxy", "haproxy"),
    ("ray::ServeController", "controller"),
    ("gcs_server", "ray gcs"),
    ("raylet", "raylet"),
    ("ray::", "other ray workers"),
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # the process exited meanwhile
        return None


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; fields[0] is the state
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def descendants(root: int) -> list[int]:
    """`root` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def role_of(pid: int, root: int) -> str:
    """The process' role in the report; a process a replica spawned (the engine core and its rank processes)
    counts as "engine core" when its nearest Ray ancestor is an engine replica."""
    if pid == root:
        return "serve CLI (driver)"
    cmdline = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ")
    if "multiprocessing" in cmdline and (st := _stat(pid)) is not None and st[0] not in (0, 1, root):
        parent = role_of(st[0], root)
        return "engine core" if parent in ("engine replica", "engine core") else parent
    return next((role for needle, role in _ROLES if needle in cmdline), "other ray processes")


def cpu_seconds_by_pid(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for the process tree under `root`."""
    out = {}
    for pid in descendants(root):
        st = _stat(pid)
        if st is not None:
            out[pid] = (role_of(pid, root), st[1])
    return out


def cpu_delta_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, per role (processes that exited in between are not counted)."""
    out: dict[str, float] = {}
    for pid, (role, sec) in after.items():
        out[role] = out.get(role, 0.0) + sec - before.get(pid, (role, 0.0))[1]
    return out


def gpu_process_roles(root: int) -> dict[str, int] | str:
    """Role -> number of processes of the tree under `root` that hold a CUDA context (nvidia-smi's compute apps),
    or why that is unknown."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    pids = [int(p) for p in done.stdout.split() if p.strip().isdigit()]
    if not pids:
        return f"nvidia-smi lists no compute processes (exit {done.returncode}; a container may hide their pids)"
    tree = set(descendants(root))
    out: dict[str, int] = {}
    for pid in pids:
        role = role_of(pid, root) if pid in tree else "outside the server"
        out[role] = out.get(role, 0) + 1
    return out


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class ServeProcess:
    """`python -m service.cli serve ...` on 127.0.0.1 with a private Ray temp dir; a context manager that waits
    until the app is up and, on exit, stops it with Ctrl-C and ends whatever of its process tree is left."""

    def __init__(
        self,
        model_path: str,
        serve_args: list[str],
        log_path: str | None = None,
        startup_timeout_s: float = 900.0,
        env: dict[str, str] | None = None,
    ):
        self.model_path = model_path
        self.model = os.path.basename(model_path.rstrip("/"))
        self.serve_args = serve_args
        self.env = dict(env or {})  # added to the server's environment
        self.tmp = tempfile.mkdtemp(prefix="hsb", dir="/tmp")  # short: Ray's socket paths live below it
        self.log_path = log_path or os.path.join(self.tmp, "serve.log")
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"  # Ray's metrics agent (Prometheus text)
        self.startup_s = 0.0
        self.proc: subprocess.Popen | None = None
        self._tree: dict[int, str | None] = {}  # the server's process tree once it is up (pid -> command line)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def serve_log_dir(self) -> str:
        return os.path.join(self.tmp, "ray")

    def __enter__(self) -> ServeProcess:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(
            RAY_TMPDIR=self.tmp,
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
            RAY_metrics_report_interval_ms=str(METRICS_REPORT_MS),
        )
        env.update(self.env)
        cmd = [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--model-path",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            self.metrics_url.rsplit(":", 1)[1].split("/")[0],
            *self.serve_args,
        ]
        self._log = open(self.log_path, "w", encoding="utf-8")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            while "Press Ctrl-C" not in (_read(self.log_path) or ""):
                if self.proc.poll() is not None or time.perf_counter() - t0 > self.startup_timeout_s:
                    raise RuntimeError(
                        f"`hybrid-serve serve` did not come up in {time.perf_counter() - t0:.0f} s; its output:\n"
                        f"{self.log_tail()}\n{self.serve_logs_tail()}"
                    )
                time.sleep(0.5)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.perf_counter() - t0
        self._tree = self._snapshot_tree()
        return self

    def _snapshot_tree(self) -> dict[int, str | None]:
        """pid -> command line of the server's process tree now."""
        assert self.proc is not None
        return {pid: _read(f"/proc/{pid}/cmdline") for pid in descendants(self.proc.pid)}

    def log_tail(self, chars: int = 4000) -> str:
        return (_read(self.log_path) or "")[-chars:]

    def serve_logs_tail(self, chars_per_file: int = 1500) -> str:
        """The end of each Serve log file of this cluster (controller, proxies, HAProxy, replicas): where a server
        that logs nothing to its console says why it is not up."""
        files = sorted(glob.glob(os.path.join(self.serve_log_dir, "session_*", "logs", "serve", "*")))
        return "\n".join(f"--- {f}\n{(_read(f) or '')[-chars_per_file:]}" for f in files if os.path.isfile(f))

    def count_log(self, needle: str) -> int:
        """Lines containing `needle` in the CLI's output and in every Ray log file of this cluster."""
        files = {  # session_latest links to the session's own folder: each file once
            os.path.realpath(f)
            for f in (
                self.log_path,
                *glob.glob(os.path.join(self.serve_log_dir, "session_*", "logs", "**", "*"), recursive=True),
            )
        }
        return sum((_read(f) or "").count(needle) for f in files if os.path.isfile(f))

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        tree = {**self._tree, **self._snapshot_tree()}  # processes orphaned since start are in the first
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid, cmdline in tree.items():  # Ray processes the CLI started and did not stop (same pid, same command)
            if pid != self.proc.pid and cmdline and _read(f"/proc/{pid}/cmdline") == cmdline:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._log.close()

    def cleanup(self) -> None:
        """Remove the Ray temp dir (logs included)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def metric_sums(text: str, names: tuple[str, ...], split_label: str | None = None) -> dict[str, float]:
    """Sums of the samples of `names` in a Prometheus text scrape, over every label set; with `split_label`, one sum
    per value of that label too (key "name{value}")."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) not in names:
            continue
        value = float(m.group(3))
        sums[m.group(1)] = sums.get(m.group(1), 0.0) + value
        labels = dict(_LABEL.findall(m.group(2) or ""))
        if split_label is not None and split_label in labels:
            key = f"{m.group(1)}{{{labels[split_label]}}}"
            sums[key] = sums.get(key, 0.0) + value
    return sums
