"""Screening before a launch: a config whose best possible figures, read off the launches already
measured, are beaten beyond the noise is not launched (pure, standard library only).

Every config meets the same load levels, so a launch with many slots (max_num_seqs) measured what
fewer slots can at best do. For a candidate C with n slots, below the top level T:

- throughput: C never has more than n requests running, so it is no faster than a launch of the
  same other flags measured at a level c >= n with at least c slots (its figure at the smallest
  such c), nor than n streams each at the fastest single stream measured. A level counts only
  where the peer's KV cache did not bind: no preemptions there, and (where known) room for c
  requests of the workload's length. A peer short of cache runs slower than C may, with more;
- TTFT at level T: T clients share n slots, so in the closed loop a request waits for about
  (T / n - 1) services of others, each at least (output_tokens - 1) tokens at the fastest single
  stream's speed. Half of that is the bound (the first wave waits less);
- single stream: at concurrency 1 the slots do not matter: the fastest of the same other flags.

Flags marked speed="size" (memory shares, the context) change only what fits: a config that
starts is no faster than one with the same other flags, and one that does not start is not on the
front either. Flags marked "" (graphs, batching, offload, dtype) must equal a measured launch's.
C is skipped when a measured config beats that bound beyond the measured noise (tuner.noise) on
one objective and is within it on the others, so no config that would reach the front is left
out. Nothing is screened before the noise is measured, nor with SLOs, request rates or length mixes
(their figures do not follow these bounds).
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.engines.base import Flag
from tuner.noise import tie_margin
from tuner.records import MAXIMIZE, OBJECTIVES, Workload


@dataclass(frozen=True)
class Measured:
    """One measured, feasible config: its params, objective means over its runs, its load levels."""

    number: int
    params: dict
    figures: dict                  # objective -> mean over the config's successful launches
    runs: int
    levels: tuple[dict, ...] = ()  # the trial's own launch: {"name", "concurrency", "throughput_tok_s", ...}
    kv_cache_tokens: int | None = None   # what the launch's KV cache held, where the engine said


@dataclass(frozen=True)
class Screened:
    """Why a config is not launched: the bound on its figures and the measured config beating it."""

    bound: dict                    # objective -> the config's best possible figure
    by: int                        # the measured trial that beats the bound
    reason: str


def levels_of(w: Workload) -> tuple[int, int] | None:
    """(throughput level, TTFT level) concurrencies of a workload the bounds hold for, else None."""
    from tuner.load.plan import closed_levels

    if (w.request_rates or w.request_rate or w.length_mix != "fixed" or w.single_stream_requests < 1
            or any(v is not None for v in (w.slo_ttft_ms, w.slo_tpot_ms, w.slo_e2e_ms))):
        return None
    closed = closed_levels(w)
    if not closed:
        return None
    top = closed[-1]
    ttft = w.ttft_level if w.ttft_level not in (None, 1) else (top if w.ttft_level is None else 1)
    return top, ttft


def bound(params: dict, measured: list[Measured], w: Workload, flags: tuple[Flag, ...],
          noise: dict) -> dict | None:
    """The best figures `params` could measure, from the launches measured so far; None when the
    measured launches say nothing about it (no launch with the same speed-relevant flags)."""
    slots = next((f.name for f in flags if f.speed == "slots"), None)
    levels = levels_of(w)
    if slots is None or levels is None or params.get(slots) is None:
        return None
    top, ttft_level = levels
    n = int(params[slots])
    if n >= top and (n >= ttft_level or ttft_level == 1):
        return None   # the candidate meets no queue of its own at the levels that count
    fixed = [f.name for f in flags if f.speed == "" and f.name in params]
    peers = [m for m in measured if all(m.params.get(k) == params.get(k) for k in fixed)]
    if not peers:
        return None
    cv = noise["single_stream_tok_s"]["cv"]
    single = max(m.figures["single_stream_tok_s"] for m in peers)
    fastest = single * (1 + 3 * cv)          # a stream no faster than the fastest seen, with room
    out = {"single_stream_tok_s": single}
    if n < top:
        # n streams, none faster than the fastest single stream; and no more than what a peer with
        # room for c >= n requests measured at level c (each peer's figure bounds it: the loosest)
        thr = n * fastest
        room = 1 + 3 * noise["throughput_tok_s"]["cv"]
        seen = []
        for m in peers:
            usable = [lv for lv in m.levels if str(lv.get("name", "")).startswith("c")
                      and n <= int(lv.get("concurrency", 0)) <= int(m.params.get(slots) or 0)
                      and lv.get("throughput_tok_s") is not None
                      and not cache_bound(m, lv, w)]
            if usable:
                lowest = min(usable, key=lambda lv: int(lv["concurrency"]))
                seen.append(float(lowest["throughput_tok_s"]) * room)
        if seen:
            thr = min(thr, max(seen))
        out["throughput_tok_s"] = thr
    else:
        out["throughput_tok_s"] = None   # not bounded: it meets the top level without a queue
    if ttft_level > 1 and n < ttft_level:
        service_ms = 1000.0 * (w.output_tokens - 1) / fastest
        out["ttft_ms"] = 0.5 * (ttft_level / n - 1) * service_ms
    else:
        out["ttft_ms"] = None
    return out


def cache_bound(m: Measured, level: dict, w: Workload) -> bool:
    """Whether `m`'s KV cache limited it at `level`: it preempted there, or it holds fewer tokens
    than the level's requests need at once (the figure then says less than its slots could do)."""
    if level.get("preemptions"):
        return True
    need = int(level.get("concurrency", 0)) * (w.prompt_tokens + w.output_tokens)
    return m.kv_cache_tokens is not None and m.kv_cache_tokens < need


def screen(params: dict, measured: list[Measured], w: Workload, flags: tuple[Flag, ...],
           noise: dict | None, tie_tolerance: float = 0.02) -> Screened | None:
    """A Screened when a measured config beats `params`' best possible figures beyond the noise."""
    if not noise or any(not noise.get(k, {}).get("cv") for k in OBJECTIVES):
        return None   # no replicate launches yet (or none that varied): ties unknown, nothing is beaten
    best = bound(params, measured, w, flags, noise)
    if best is None:
        return None
    for m in measured:
        better, worse = [], False
        for k in OBJECTIVES:
            if best[k] is None:   # unbounded: assume the candidate could be as good as anything
                worse = True
                break
            a, b = float(m.figures[k]), float(best[k])
            gain = (a - b) if MAXIMIZE[k] else (b - a)
            margin = tie_margin(k, a, b, m.runs, 1, noise, tie_tolerance)
            if gain < -margin:
                worse = True
                break
            if gain > margin:
                better.append(k)
        if not worse and better:
            shown = ", ".join(f"{k} {best[k]:.4g}" for k in OBJECTIVES)
            return Screened(best, m.number, f"at best {shown}; trial {m.number} beats it beyond "
                            f"the noise on {', '.join(better)}")
    return None
