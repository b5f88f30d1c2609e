"""What a closed-loop ISL/OSL throughput run can reach, from measured step costs: the engine's schedule (decode rows
first, then prefill chunks in the token budget left, admission as requests finish) simulated step by step, each
step costing the decode time of its decode rows plus the prefill time of its prefill tokens plus a host gap when it
mixes both (--mixed-gap-ms: the device idle while the host prepares it; 0 when mixed steps are launched ahead).

Inputs are measured numbers: the decode step time at a few batch sizes (linear between them, e.g. graph replays of
`engine_bench.py`), the prefill rate (tokens/s of whole 1K prompts, `engine_bench.py --isl 1024`) and the host gap
of a mixed step (`engine_bench.py --tp-trace-at`).

    python benchmarks/closed_loop_model.py --decode-ms 1:2.4,256:25.8,512:36.2,1024:60 --prefill-tps 65000
"""

from __future__ import annotations

import argparse
import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class LoopCosts:
    decode_ms: tuple[tuple[int, float], ...]  # (batch, ms per decode step), ascending batch
    prefill_tps: float  # prefill tokens per second (weights read included)
    mixed_gap_ms: float  # device idle per step that holds both prefill and decode rows (host work not hidden)

    def decode_step_ms(self, batch: int) -> float:
        """ms of a decode step of `batch` rows: linear between the measured batches, proportional beyond them."""
        if batch <= 0:
            return 0.0
        xs = [b for b, _ in self.decode_ms]
        i = bisect.bisect_left(xs, batch)
        if i < len(xs) and xs[i] == batch:
            return self.decode_ms[i][1]
        if i == 0:
            return self.decode_ms[0][1]
        if i == len(xs):
            b, ms = self.decode_ms[-1]
            return ms * batch / b
        (b0, m0), (b1, m1) = self.decode_ms[i - 1], self.decode_ms[i]
        return m0 + (m1 - m0) * (batch - b0) / (b1 - b0)


@dataclass(frozen=True)
class LoopResult:
    seconds: float
    output_tps: float
    steps: int
    mixed_steps: int
    decode_seconds: float  # time of the steps' decode rows
    prefill_seconds: float  # time of the steps' prefill tokens
    gap_seconds: float  # host gaps of mixed steps


def simulate(costs: LoopCosts, num_prompts: int, isl: int, osl: int, concurrency: int, token_budget: int) -> LoopResult:
    """Steps of the closed loop until every request has its osl tokens (the first one sampled when its prefill
    ends, one per decode step after)."""
    pending = num_prompts
    running: list[list[int]] = []  # [prefilled tokens, output tokens] per request, admission order
    t = dec_s = pre_s = gap_s = 0.0
    steps = mixed = 0
    done = 0
    while done < num_prompts:
        while pending and len(running) < concurrency:
            running.append([0, 0])
            pending -= 1
        budget, decode_rows, prefill_tokens = token_budget, 0, 0
        for r in running:
            if budget <= 0:
                break
            if r[0] == isl:
                decode_rows += 1
                budget -= 1
                r[1] += 1
            else:
                n = min(isl - r[0], budget)
                r[0] += n
                budget -= n
                prefill_tokens += n
                r[1] += r[0] == isl  # the prompt's last chunk samples the first output token
        d_ms = costs.decode_step_ms(decode_rows)
        p_ms = 1e3 * prefill_tokens / costs.prefill_tps
        g_ms = costs.mixed_gap_ms if prefill_tokens and decode_rows else 0.0
        t += (d_ms + p_ms + g_ms) / 1e3
        dec_s, pre_s, gap_s = dec_s + d_ms / 1e3, pre_s + p_ms / 1e3, gap_s + g_ms / 1e3
        steps += 1
        mixed += bool(prefill_tokens and decode_rows)
        finished = [r for r in running if r[1] >= osl]
        done += len(finished)
        running = [r for r in running if r[1] < osl]
    return LoopResult(t, num_prompts * osl / t, steps, mixed, dec_s, pre_s, gap_s)


def parse_decode_ms(text: str) -> tuple[tuple[int, float], ...]:
    """'1:2.4,256:25.8' -> ((1, 2.4), (256, 25.8)), sorted by batch."""
    pairs = []
    for item in text.split(","):
        b, _, ms = item.partition(":")
        pairs.append((int(b), float(ms)))
    return tuple(sorted(pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-ms", required=True, help="batch:ms pairs of measured decode steps, e.g. 1:2.4,1024:60")
    ap.add_argument("--prefill-tps", type=float, required=True, help="measured prefill tokens/s")
    ap.add_argument("--mixed-gap-ms", type=float, default=0.0, help="device idle per mixed step (host work)")
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--osl", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=1024)
    ap.add_argument("--token-budget", type=int, default=8192)
    args = ap.parse_args()
    costs = LoopCosts(parse_decode_ms(args.decode_ms), args.prefill_tps, args.mixed_gap_ms)
    r = simulate(costs, args.num_prompts, args.isl, args.osl, args.concurrency, args.token_budget)
    print(
        f"{args.num_prompts} x {args.isl}/{args.osl} at concurrency {args.concurrency}, budget {args.token_budget}: "
        f"{r.output_tps:,.0f} output tok/s over {r.seconds:.1f} s, {r.steps} steps ({r.mixed_steps} mixed); "
        f"decode {r.decode_seconds:.1f} s, prefill {r.prefill_seconds:.1f} s, mixed-step gaps {r.gap_seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
