"""`hybrid-serve generate`: offline generation with the engine (no Ray, no HTTP)."""

from __future__ import annotations

import argparse
import json
import logging
import time

from service.engine.config import EngineConfig
from service.engine.settings import add_setting_arguments, settings_from_namespace


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline with the engine")
    add_setting_arguments(p, EngineConfig, "engine settings (EngineConfig)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of every prompt's sampling")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from service.engine import Engine, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = Engine(EngineConfig(**settings_from_namespace(args, EngineConfig)))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt
    if args.chat:
        if engine.tokenizer is None:
            raise SystemExit("--chat needs a tokenizer in the model folder")
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    for o in outs:
        if args.json:
            print(json.dumps({"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}))
        else:
            print(f"--- {o.request_id[:8]} ({len(o.token_ids)} tokens, {o.finish_reason})\n{o.text}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"# {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tok/s)")
    return 0
