"""The OpenAI-compatible HTTP ingress (docs/design.md: Serving): `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (SSE streaming and not), `/health`.

The ingress validates the body (`service.openai.protocol`), renders the chat template, tokenizes,
checks the context length, builds `SamplingParams`, then opens one engine stream per choice and waits for
each stream's first chunk before answering, so that refusals become proper HTTP errors. Each stream is its own
`generate` call, or, with `group_max_requests` > 1, the streams of the requests that arrive together share one
Serve call (`generate_group`, groups.py; each request routed by the prefix-aware router on its own). Errors are
OpenAI error objects: 400 bad parameters / prompt too long (`context_length_exceeded`), 404 unknown
model, 413 body over 8 MiB, 503 overloaded or no engine; `service.deployments.gate` adds 401 (API key) and
429 / 400 (per-key limits and per-request caps) in front of the handlers. A client that goes away cancels the engine calls, which abort
the requests in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from service.deployments.args import AppArgs
from service.deployments.choices import ChoiceOptions, ChoiceState
from service.deployments.engine_deployment import OVERLOADED, OVERLOADED_MESSAGE, GenerateChunk
from service.deployments.gate import ASGIApp, HotRoutes, RequestGate, request_shape
from service.deployments.groups import GroupDispatcher, GroupMember
from service.deployments.openapi_doc import document_openai_routes
from service.deployments.sse import SSEResponse
from service.engine import SamplingParams
from service.engine.tokenizer import Tokenizer
from service.openai import reasoning
from service.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    error_from_validation,
    random_id,
    to_sampling_kwargs,
)
from service.openai.responses import SSE_DONE, StreamEvents

logger = logging.getLogger("ray.serve")
HEALTH_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 8 * 1024 * 1024  # larger request bodies get 413


class APIError(Exception):
    """Raised inside a handler; becomes the OpenAI error response it carries."""

    def __init__(self, response: ErrorResponse):
        super().__init__(response.error.message)
        self.response = response


def _error_json(err: ErrorResponse) -> JSONResponse:
    return JSONResponse(err.model_dump(mode="json"), status_code=err.status_code)


def _overloaded() -> ErrorResponse:
    return ErrorResponse.make(OVERLOADED_MESSAGE, status=503, code=OVERLOADED)


def _invalid(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(ErrorResponse.make(message, param=param, status=400, code=code))


@dataclass(frozen=True)
class PreparedPrompt:
    """One tokenized prompt and the sampling parameters of each of its choices."""

    token_ids: list[int]  # prompt token ids
    params: list[SamplingParams]  # one per choice (seeds differ when a seed is given)
    first_choice_index: int  # response index of this prompt's first choice


@dataclass
class OpenStream:
    """One engine call whose first chunk has arrived."""

    choice_index: int
    first: GenerateChunk
    rest: Any  # the DeploymentResponseGenerator or MemberStream (already advanced past `first`)


@serve.ingress()
class OpenAIIngress:
    """Serve deployment holding a handle to the engine deployment (the router lives in this process)."""

    async def __init__(self, engine: DeploymentHandle, app_args: dict[str, Any]):
        self._args = AppArgs.model_validate(app_args)
        self._engine = engine
        # the engine calls' arguments and chunks are module-level types: the C pickler serializes them (Serve's
        # default, cloudpickle, costs more per chunk); used on Serve's gRPC path between deployments
        self._generate_call = engine.options(
            method_name="generate", stream=True, request_serialization="pickle", response_serialization="pickle"
        )
        # several requests per engine call (groups.py); with a limit of 1, one `generate` call per request
        self._groups = (
            GroupDispatcher(engine, self._args.group_max_requests) if self._args.group_max_requests > 1 else None
        )
        self._tokenizer = Tokenizer.from_model_path(self._args.model_path)
        self._model_name = self._args.served_model_name or os.path.basename(self._args.model_path.rstrip("/"))
        self._gate = RequestGate.from_args(self._args.api_keys_file, self._args.limits)
        info = await engine.info.remote()
        self._max_model_len = int(info["max_model_len"])

    def __serve_build_asgi_app__(self) -> ASGIApp:
        """The gate (API keys on /v1/*, per-key limits on the generation routes) in front of the two generation
        routes, which are called directly (`HotRoutes`), and of the FastAPI app serving every other request."""
        app = FastAPI(title="hybrid-serve", docs_url=None, redoc_url=None)
        generation = {"/v1/chat/completions": self._guard(self.chat_completions),
                      "/v1/completions": self._guard(self.completions)}  # fmt: skip
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        for path, handler in generation.items():  # the FastAPI routes: the OpenAPI document, 405 for other methods
            app.add_api_route(path, handler, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        document_openai_routes(app)  # request/response/error schemas in /openapi.json
        return self._gate.wrap(HotRoutes(generation, app), app)

    @staticmethod
    def _guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Map every failure of a handler to an OpenAI error response (a replica never crashes on input)."""

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return _error_json(exc.response)
            except BackPressureError:
                return _error_json(_overloaded())
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("request failed")
                return _error_json(
                    ErrorResponse.make("Internal error while generating.", status=500, code="internal_error")
                )

        return guarded

    # ---- simple endpoints ----
    async def list_models(self) -> JSONResponse:
        card = ModelCard(id=self._model_name, root=self._args.model_path, max_model_len=self._max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self._engine.info.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception:  # any failure to reach an engine replica means "not healthy"
            return _error_json(ErrorResponse.make("No engine replica answered.", status=503, code="unavailable"))
        return JSONResponse({"status": "ok"})

    # ---- shared request preparation ----
    async def _parse(self, request: Request, model: type[pydantic.BaseModel]) -> Any:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise APIError(
                ErrorResponse.make(
                    f"Request body of {len(body)} bytes exceeds the limit of {MAX_BODY_BYTES}.",
                    status=413,
                    code="request_too_large",
                )
            )
        try:
            parsed = model.model_validate_json(body)
        except pydantic.ValidationError as exc:
            raise APIError(error_from_validation(exc)) from None
        if parsed.model is not None and parsed.model != self._model_name:
            raise APIError(
                ErrorResponse.make(
                    f"The model '{parsed.model}' does not exist; this server serves '{self._model_name}'.",
                    param="model",
                    status=404,
                    code="model_not_found",
                )
            )
        return parsed

    def _prepare(self, req: Any, token_ids: list[int], param: str, first_choice_index: int) -> PreparedPrompt:
        """Length checks and per-choice SamplingParams for one prompt."""
        if not token_ids:
            raise _invalid(f"'{param}' must not be empty.", param)
        budget = self._max_model_len - len(token_ids)
        if budget < 1:
            raise _invalid(
                f"This model's maximum context length is {self._max_model_len} tokens; the {param} has "
                f"{len(token_ids)} tokens.",
                param,
                code="context_length_exceeded",
            )
        kwargs = to_sampling_kwargs(req, default_max_tokens=self._gate.default_max_tokens(budget))
        if kwargs["max_tokens"] > budget:
            raise _invalid(
                f"max_tokens ({kwargs['max_tokens']}) plus the prompt ({len(token_ids)} tokens) exceeds "
                f"the maximum context length of {self._max_model_len} tokens.",
                "max_tokens",
                code="context_length_exceeded",
            )
        kwargs.setdefault("skip_special_tokens", req.skip_special_tokens)
        params = []
        for i in range(req.n):
            seed = None if kwargs["seed"] is None else kwargs["seed"] + i
            try:
                params.append(SamplingParams(**{**kwargs, "seed": seed}))
            except ValueError as exc:
                raise _invalid(str(exc), str(exc).split(" ", 1)[0]) from None
        return PreparedPrompt(token_ids, params, first_choice_index)

    def _chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        try:
            text = self._tokenizer.apply_chat_template(
                req.template_messages(),
                tools=req.template_tools(),
                add_generation_prompt=True,
                **(req.chat_template_kwargs or {}),
            )
        except ValueError as exc:
            raise _invalid(str(exc), "messages") from None
        return text, self._tokenizer.encode(text)

    def _completion_prompts(self, req: CompletionRequest) -> list[PreparedPrompt]:
        prepared = []
        for k, prompt in enumerate(req.prompts()):
            if isinstance(prompt, str):
                ids = self._tokenizer.encode(prompt)
            else:
                ids = list(prompt)
                try:
                    self._tokenizer.validate_token_ids(ids, field="prompt")
                except ValueError as exc:
                    raise _invalid(str(exc), "prompt") from None
            prepared.append(self._prepare(req, ids, "prompt", k * req.n))
        return prepared

    def _admit(self, request: Request, req: Any, prompts: list[PreparedPrompt], states: list[ChoiceState]) -> None:
        """Per-request caps and the key's token reservation (settled with the real usage when the request ends)."""
        shape = request_shape(req.n, [(p.token_ids, p.params) for p in prompts])
        refusal = self._gate.admit(request, shape, lambda: self._usage(prompts, states).total_tokens)
        if refusal is not None:
            raise APIError(refusal)

    # ---- engine calls ----
    async def _open(self, prompts: list[PreparedPrompt], request_id: str) -> list[OpenStream]:
        """Start every choice's engine call and wait for each first chunk; refusals raise APIError."""
        calls = [(p.first_choice_index + i, p.token_ids, params) for p in prompts for i, params in enumerate(p.params)]
        if self._groups is not None:
            gens = [self._groups.open(GroupMember(ids, params, f"{request_id}-{idx}")) for idx, ids, params in calls]
        else:
            gens = [self._generate_call.remote(ids, params, f"{request_id}-{idx}") for idx, ids, params in calls]
        try:  # (one call, the common case, is awaited directly: no task)
            firsts = (
                [await gens[0].__anext__()] if len(gens) == 1 else await asyncio.gather(*(g.__anext__() for g in gens))
            )
        except BaseException:
            for g in gens:
                g.cancel()
            raise
        streams = [OpenStream(idx, first, g) for (idx, _, _), first, g in zip(calls, firsts, gens)]
        refused = next((s.first for s in streams if s.first.error), None)
        if refused is not None:
            for s in streams:
                s.rest.cancel()
            if refused.error_code == OVERLOADED:  # the engine replica's bound on open requests, as Serve's queue's
                raise APIError(_overloaded())
            refused = refused.error
            raise _invalid(
                refused,
                "prompt" if "prompt" in refused else None,
                code="context_length_exceeded" if "max_model_len" in refused else None,
            )
        return streams

    @staticmethod
    async def _merged(streams: list[OpenStream]) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """(choice index, chunk) from all streams as they arrive, each read to its end (a call that ended needs no
        cancel); cancels every call not read to its end when left early."""
        if len(streams) == 1:  # one choice: read its stream directly (no queue, no pump task)
            s = streams[0]
            ended = False
            try:
                yield s.choice_index, s.first
                async for chunk in s.rest:
                    yield s.choice_index, chunk
                ended = True
            finally:
                if not ended:
                    s.rest.cancel()
            return
        queue: asyncio.Queue = asyncio.Queue()
        ended: set[int] = set()  # choice indexes whose calls were read to their ends

        async def pump(s: OpenStream) -> None:
            try:
                await queue.put((s.choice_index, s.first))
                async for chunk in s.rest:
                    await queue.put((s.choice_index, chunk))
                ended.add(s.choice_index)
                await queue.put((s.choice_index, None))
            except Exception as exc:  # handed to the consumer, which re-raises it
                await queue.put((s.choice_index, exc))

        tasks = [asyncio.create_task(pump(s)) for s in streams]
        remaining = len(streams)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                if s.choice_index not in ended:
                    s.rest.cancel()

    @staticmethod
    def _check_not_aborted(chunk: GenerateChunk) -> None:
        if chunk.finish_reason == "abort":
            raise APIError(
                ErrorResponse.make(
                    "The engine aborted the request (shutting down?); retry.", status=503, code="aborted"
                )
            )

    def _usage(self, prompts: list[PreparedPrompt], states: list[ChoiceState]) -> Usage:
        return Usage.make(
            prompt_tokens=sum(len(p.token_ids) for p in prompts),
            completion_tokens=sum(len(s.token_ids) for s in states),
            cached_tokens=max((s.num_cached_tokens for s in states), default=0),
        )

    # ---- /v1/chat/completions ----
    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        prompt_text, ids = self._chat_prompt(req)
        prompt = self._prepare(req, ids, "messages", 0)
        tool_parser = self._args.tool_call_parser if req.tools_enabled else None
        options = [
            ChoiceOptions(
                i,
                req.top_logprobs or 0,
                req.logprobs,
                reasoning_parser=self._args.reasoning_parser,
                tool_parser=tool_parser,
                tools=tuple(req.tools or ()),
                starts_in_reasoning=reasoning.prompt_starts_in_reasoning(prompt_text),
            )
            for i in range(req.n)
        ]
        states = [ChoiceState(o, self._tokenizer) for o in options]
        self._admit(request, req, [prompt], states)
        request_id = random_id("chatcmpl")
        streams = await self._open([prompt], request_id)
        if req.stream:
            events = StreamEvents("chat.completion.chunk", request_id, self._model_name)
            usage = lambda: self._usage([prompt], states)  # noqa: E731
            return SSEResponse(self._events(streams, states, usage, events, True, req.include_usage_in_stream))
        async with contextlib.aclosing(self._merged(streams)) as merged:
            async for index, chunk in merged:
                self._check_not_aborted(chunk)
                states[index].add(chunk)
                states[index].collect_logprobs(chunk)
        response = ChatCompletionResponse(
            id=request_id,
            model=self._model_name,
            choices=[s.final_chat() for s in states],
            usage=self._usage([prompt], states),
        )
        return JSONResponse(response.model_dump(mode="json"))

    # ---- /v1/completions ----
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        prompts = self._completion_prompts(req)
        k = req.logprobs or 0
        states = [
            ChoiceState(ChoiceOptions(i, k, req.logprobs is not None), self._tokenizer)
            for i in range(len(prompts) * req.n)
        ]
        self._admit(request, req, prompts, states)
        request_id = random_id("cmpl")
        streams = await self._open(prompts, request_id)
        if req.stream:
            events = StreamEvents("text_completion", request_id, self._model_name)
            usage = lambda: self._usage(prompts, states)  # noqa: E731
            return SSEResponse(self._events(streams, states, usage, events, False, req.include_usage_in_stream))
        async with contextlib.aclosing(self._merged(streams)) as merged:
            async for index, chunk in merged:
                self._check_not_aborted(chunk)
                states[index].add_completion(chunk)
        response = CompletionResponse(
            id=request_id,
            model=self._model_name,
            choices=[s.final_completion() for s in states],
            usage=self._usage(prompts, states),
        )
        return JSONResponse(response.model_dump(mode="json"))

    # ---- SSE ----
    async def _events(
        self,
        streams: list[OpenStream],
        states: list[ChoiceState],
        usage: Callable[[], Usage],
        events: StreamEvents,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """SSE text for a chat or completion stream; a failure mid-stream becomes an error event. The last choice's
        finishing event, the usage event (`include_usage`) and [DONE] leave as one text (the response's last write);
        the engine calls are then read to their ends."""
        unfinished = len(streams)
        async with contextlib.aclosing(self._merged(streams)) as merged:  # its finally cancels the engine calls
            try:
                async for index, chunk in merged:
                    self._check_not_aborted(chunk)
                    state = states[index]
                    if chat:
                        state.add(chunk)
                        choice = state.delta_chat_json(chunk)
                    else:
                        choice = state.add_completion_json(chunk)
                    text = "" if choice is None else events.choice(choice)
                    if chunk.finish_reason is not None:
                        unfinished -= 1
                        if not unfinished:
                            text += (events.usage(usage()) if include_usage else "") + SSE_DONE
                    if text:
                        yield text
                if unfinished:  # a call ended without its finishing chunk
                    yield (events.usage(usage()) if include_usage else "") + SSE_DONE
                return
            except APIError as exc:
                yield f"data: {exc.response.model_dump_json()}\n\n"
            except BackPressureError:
                yield f"data: {_overloaded().model_dump_json()}\n\n"
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("stream failed")
                yield f"data: {ErrorResponse.make('Internal error while generating.', status=500).model_dump_json()}\n\n"
            yield SSE_DONE
