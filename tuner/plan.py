"""The load plan: the levels a workload defines, the same for every config (pure, standard library only)."""

from __future__ import annotations

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
    """The levels every config is measured at, in order (warm-up not included)."""
    plan = []
    if w.single_stream_requests > 0:
        plan.append(Level("single_stream", 1, w.single_stream_requests))
    for c in closed_levels(w):
        plan.append(Level(f"c{c}", c, max(w.waves * c, w.throughput_requests)))
    rates = tuple(w.request_rates) or ((w.request_rate,) if w.request_rate else ())
    cap = max(256, 4 * max(closed_levels(w) or (w.max_concurrency,)))
    for r in sorted(set(rates)):
        plan.append(Level(f"r{r:g}", cap, w.throughput_requests, r))
    return tuple(plan)


def ttft_level_name(w: Workload) -> str:
    """The phase whose TTFT is the objective: `ttft_level`, else the top closed-loop level."""
    plan = [lv for lv in load_plan(w) if lv.request_rate is None]
    if w.ttft_level is not None:
        for lv in plan:
            if lv.concurrency == w.ttft_level:
                return lv.name
    return plan[-1].name if plan else ""
