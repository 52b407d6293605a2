"""The load plan: the levels a workload defines, the same for every config (pure, standard library only)."""

from __future__ import annotations

import math

from tuner.records import Level, Workload


def default_levels(max_concurrency: int) -> tuple[int, ...]:
    """4, 16, 64, ... below the cap, then the cap itself: the closed-loop ladder above 1."""
    out, c = [], 4
    while c < max_concurrency:
        out.append(c)
        c *= 4
    if max_concurrency > 1:
        out.append(max_concurrency)
    return tuple(out)


def closed_levels(w: Workload) -> tuple[int, ...]:
    if w.levels:
        chosen = w.levels
    elif w.concurrency is not None:
        chosen = (w.concurrency,)
    else:
        chosen = default_levels(w.max_concurrency)
    return tuple(sorted({c for c in chosen if c > 1}))


def load_plan(w: Workload) -> tuple[Level, ...]:
    """The levels every config is measured at, in order (warm-up not included).

    A closed-loop level sends at least `waves` x its concurrency (and `throughput_requests`)
    requests; with `level_seconds` it keeps sending until it has run that long, up to `max_waves`
    x its concurrency. A rate level sends `throughput_requests`, or rate x `level_seconds` when
    that is more: a count fixed by the workload alone.
    """
    plan = []
    if w.single_stream_requests > 0:
        plan.append(Level("single_stream", 1, w.single_stream_requests))
    for c in closed_levels(w):
        floor = max(w.waves * c, w.throughput_requests)
        if w.level_seconds > 0:
            plan.append(Level(f"c{c}", c, floor, seconds=w.level_seconds,
                              max_requests=max(floor, w.max_waves * c)))
        else:
            plan.append(Level(f"c{c}", c, floor))
    rates = tuple(w.request_rates) or ((w.request_rate,) if w.request_rate else ())
    cap = max(256, 4 * max(closed_levels(w) or (w.max_concurrency,)))
    for r in sorted(set(rates)):
        plan.append(Level(f"r{r:g}", cap, max(w.throughput_requests, math.ceil(r * w.level_seconds)), r))
    return tuple(plan)


def requests_to_prepare(level: Level, previous_latency_s: float | None) -> int:
    """How many prompts a level needs ready: its floor, or for a level with a time floor enough to
    keep `concurrency` requests in flight for `seconds` at the latency of the level before it (a
    request at this concurrency takes no less), plus a wave for the drain, capped at `max_requests`.
    Without a latency to go by, the cap."""
    if level.seconds <= 0 or level.max_requests <= level.requests:
        return level.requests
    if not previous_latency_s or previous_latency_s <= 0:
        return level.max_requests
    want = math.ceil(level.seconds * level.concurrency / previous_latency_s) + level.concurrency
    return max(level.requests, min(level.max_requests, want))


def ttft_level_name(w: Workload) -> str:
    """The phase whose TTFT is the objective: `ttft_level`, else the top closed-loop level."""
    plan = [lv for lv in load_plan(w) if lv.request_rate is None]
    if w.ttft_level is not None:
        for lv in plan:
            if lv.concurrency == w.ttft_level:
                return lv.name
    return plan[-1].name if plan else ""


FIXED_LENGTH_LEVELS = ("warmup", "single_stream")


def level_lengths(w: Workload, plan: tuple[Level, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The (prompt_tokens, output_tokens) of every request of every level of `plan`, in order.

    Warm-up and single stream send the fixed lengths (single-stream speed is defined at them);
    the load levels draw from the workload's length mix with its seed, in plan order, so the
    sequence depends on the workload alone and every config meets the same one.
    """
    import random

    from tuner.load.lengths import draw_lengths

    rng = random.Random(f"lengths:{w.seed}")
    fixed = (w.prompt_tokens, w.output_tokens)
    return tuple(tuple([fixed] * lv.requests) if lv.name in FIXED_LENGTH_LEVELS
                 else tuple(draw_lengths(w, lv.requests, rng)) for lv in plan)


def extra_lengths(w: Workload, level: Level, count: int) -> tuple[tuple[int, int], ...]:
    """The lengths of the requests a time-floored level sends beyond its floor: the fixed lengths,
    or draws from the length mix with a seed of the workload's and the level's, so every config
    that sends them meets the same sequence."""
    import random

    from tuner.load.lengths import draw_lengths

    return tuple(draw_lengths(w, count, random.Random(f"lengths:{w.seed}:{level.name}:more")))


def _lengths_sent(w: Workload) -> list[tuple[tuple[int, int], ...]]:
    """Per level of the plan, every request it may send in order: its floor, then (a level with a
    time floor) the most extra requests it may prepare. How many extras a config sends depends on
    its speed; they are drawn in one sequence, so any count sends a prefix of these."""
    plan = load_plan(w)
    out = []
    for level, lengths in zip(plan, level_lengths(w, plan)):
        more = level.max_requests - level.requests if level.seconds > 0 else 0
        out.append(lengths + (extra_lengths(w, level, more) if more > 0 else ()))
    return out


def longest_request(w: Workload) -> int:
    """The most tokens (prompt + output) one request of the plan may hold, time-floor extras included."""
    return max([w.prompt_tokens + w.output_tokens]
               + [p + o for level in _lengths_sent(w) for p, o in level])


def share_too_long(w: Workload, max_model_len: int) -> float:
    """The largest share of a level's requests that a server of this context refuses for length,
    over every count of requests the level may send (its floor up to its cap)."""
    worst = 0.0
    for level, lengths in zip(load_plan(w), _lengths_sent(w)):
        too_long = 0
        for i, (p, o) in enumerate(lengths, start=1):
            too_long += p + o > max_model_len
            if i >= level.requests:
                worst = max(worst, too_long / i)
    return worst


def context_too_short(w: Workload, max_model_len: int | None) -> tuple[float, str] | None:
    """Why a server of this context cannot serve the workload, or None: more of a level's requests
    would be refused for length than a load test tolerates (any request at all with fixed lengths).
    Returns (the share refused, the reason in words)."""
    if max_model_len is None:
        return None
    too_long = share_too_long(w, max_model_len)
    if too_long <= (w.max_failed_share if w.length_mix != "fixed" else 0.0):
        return None
    if w.length_mix == "fixed":
        return too_long, f"the workload's {w.prompt_tokens} + {w.output_tokens} tokens per request"
    # read after "max_model_len N <" and "... is below": the requests it is shorter than
    share = f"{too_long:.0%}" if too_long >= 0.01 else f"{too_long:.1%}"
    return too_long, (f"the longest {share} of a level's requests of the {w.length_mix} "
                      f"length mix (more than max_failed_share {w.max_failed_share:g})")
