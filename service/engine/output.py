"""Turns sampled tokens into request progress: append, detokenise, stop checks, outputs."""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.request import FinishReason, Request, RequestOutput
from service.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    max_stop_len: int  # longest stop string (chars held back while running)


class OutputProcessor:
    """detokenize=False: only requests with stop strings get text (the caller detokenises the others)."""

    def __init__(
        self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_model_len: int, detokenize: bool = True
    ):
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.text: dict[str, _TextState] = {}  # request_id -> detokenizer state

    def add_request(self, req: Request) -> None:
        if self.tokenizer is None:
            if req.params.stop:
                raise ValueError("stop strings need a tokenizer; this model folder has none (use stop_token_ids)")
            return
        if not self.detokenize and not req.params.stop:
            return
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=req.params.skip_special_tokens)
        self.text[req.request_id] = _TextState(detok, max((len(s) for s in req.params.stop), default=0))

    def append(self, req: Request, token_id: int, logprob: float | None, top: dict[int, float] | None) -> None:
        """Adds one sampled token and sets req.finish_reason if it ends the request."""
        req.output_token_ids.append(token_id)
        if req.params.logprobs and logprob is not None:
            req.output_logprobs.append(logprob)
        if req.params.top_logprobs and top is not None:
            req.output_top_logprobs.append(top)
        p = req.params
        if token_id in p.stop_token_ids or (token_id in self.eos_token_ids and not p.ignore_eos):
            req.finish_reason = FinishReason.STOP
        state = self.text.get(req.request_id)
        if state is not None:
            before = len(req.text)
            req.text += state.detok.add([token_id])
            if p.stop and self._cut_stop(req, before, state.max_stop_len):
                req.finish_reason = FinishReason.STOP
        if req.finish_reason is None and self.reaches_length(req):
            req.finish_reason = FinishReason.LENGTH

    def reaches_length(self, req: Request, num_more: int = 0) -> bool:
        """req, with num_more more output tokens, is at max_tokens or max_model_len."""
        return (
            len(req.output_token_ids) + num_more >= req.params.max_tokens
            or req.num_tokens + num_more >= self.max_model_len
        )

    @staticmethod
    def _cut_stop(req: Request, before: int, max_len: int) -> bool:
        start = max(0, before - max_len + 1)
        hits = [i for i in (req.text.find(s, start) for s in req.params.stop) if i >= 0]
        if not hits:
            return False
        req.text = req.text[: min(hits)]
        return True

    def make_output(self, req: Request) -> RequestOutput:
        text = req.text
        if req.finish_reason is None and req.params.stop:
            text = text[: len(text) - _partial_stop_len(text, req.params.stop)]
        p = req.params
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            text=text,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(req.output_token_ids),
            output_token_ids=req.output_token_ids,
            output_logprobs=req.output_logprobs if p.logprobs else None,
            output_top_logprobs=req.output_top_logprobs if p.top_logprobs else None,
        )

    def release(self, request_id: str) -> None:
        self.text.pop(request_id, None)


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string (held back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
