"""The HTTP client of `serving_bench`: a case's requests streamed at its concurrency (a closed loop: the next request
is sent when one finishes), in this process or split over forked client processes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor

import aiohttp
import httpx

from benchmarks.serving_cases import ENDPOINTS, Case, Workload
from benchmarks.serving_procs import own_cpu_seconds
from loadtests.bench_client import RequestResult, Summary, stream_request, stream_request_aiohttp, summarize


async def closed_loop_http(
    base_url: str, model: str, case: Case, timeout_s: float, http_client: str
) -> tuple[Summary, list]:
    """The case's requests streamed at its concurrency (a closed loop) over `http_client` ("aiohttp" or "httpx")."""
    conc = case.workload.concurrency
    path = ENDPOINTS[case.endpoint]
    async with contextlib.AsyncExitStack() as stack:
        if http_client == "aiohttp":
            session = await stack.enter_async_context(
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=conc + 8), timeout=aiohttp.ClientTimeout(total=timeout_s)
                )
            )
            send = functools.partial(stream_request_aiohttp, session, base_url + path)
        else:
            limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits)
            )
            send = functools.partial(stream_request, client, path)
        gate = asyncio.Semaphore(conc)

        async def one(body: dict) -> RequestResult:
            async with gate:
                return await send({**body, "model": model})

        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in case.bodies))
        return summarize(list(results), time.perf_counter() - start), list(results)


def _client_results(base_url: str, model: str, case: Case, timeout_s: float, http_client: str) -> list[RequestResult]:
    """One client process' share of a closed loop (run in a worker process)."""
    return asyncio.run(closed_loop_http(base_url, model, case, timeout_s, http_client))[1]


def _started(_: int) -> None:
    """A no-op task: the pool's worker processes exist once it has run."""


def closed_loop_clients(
    base_url: str, model: str, case: Case, timeout_s: float, procs: int, http_client: str
) -> tuple[Summary, float]:
    """(summary, client CPU seconds) of the closed loop run by `procs` client processes (forked before the clock
    starts), each with every procs-th request and its share of the concurrency, so that one client's event loop is
    not the limit."""
    if procs == 1:
        own0 = own_cpu_seconds()
        summary, _ = asyncio.run(closed_loop_http(base_url, model, case, timeout_s, http_client))
        return summary, own_cpu_seconds() - own0
    w = case.workload
    parts = []
    for i in range(procs):
        bodies = case.bodies[i::procs]
        conc = w.concurrency // procs + (i < w.concurrency % procs)
        parts.append(Case(Workload(w.isl, w.osl, len(bodies), max(conc, 1)), case.endpoint, bodies, []))
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(_started, range(procs)))
        start = time.perf_counter()
        futures = [pool.submit(_client_results, base_url, model, part, timeout_s, http_client) for part in parts]
        results = [r for f in futures for r in f.result()]
        duration = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime
    return summarize(results, duration), cpu
