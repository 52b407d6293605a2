"""Request length mixes: the (prompt, output) token lengths a workload's load levels send (pure, standard library only)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tuner.errors import TunerError

LENGTH_MIXES = ("fixed", "uniform", "normal", "trace")
TRACES_DIR = Path(__file__).parent / "traces"


class TraceError(TunerError):
    """A length trace that cannot be read: no load test can be planned from it."""

    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"length trace {path}: {problem}")


def read_trace(path: str) -> tuple[tuple[int, int], ...]:
    """The (prompt_tokens, output_tokens) pairs of a JSONL trace, one object per line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise TraceError(path, f"cannot read: {e.strerror}") from None
    pairs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pair = (row["prompt_tokens"], row["output_tokens"])
        except (ValueError, KeyError, TypeError):
            raise TraceError(path, f"line {n} is not a JSON object with prompt_tokens and "
                                   "output_tokens") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair):
            raise TraceError(path, f"line {n}: lengths must be integers >= 1, got {pair}")
        pairs.append(pair)
    if not pairs:
        raise TraceError(path, "holds no requests")
    return tuple(pairs)


def resolve_trace(name: str, study_dir: Path) -> Path:
    """A trace named in a study: a path (relative to the study file), else one shipped in tuner/load/traces."""
    for candidate in (study_dir / name, TRACES_DIR / name, TRACES_DIR / f"{name}.jsonl"):
        if candidate.is_file():
            return candidate.resolve()
    raise TraceError(name, f"not found next to the study file ({study_dir}) nor in {TRACES_DIR}")


def _draw(spec: tuple[float, ...], kind: str, rng: random.Random) -> int:
    if kind == "uniform":
        return rng.randint(int(spec[0]), int(spec[1]))
    mean, sd = spec[0], spec[1]
    low = spec[2] if len(spec) > 2 else 1
    high = spec[3] if len(spec) > 3 else mean + 3 * sd
    return int(round(min(max(rng.gauss(mean, sd), low), high)))


def draw_lengths(w, count: int, rng: random.Random) -> list[tuple[int, int]]:
    """`count` (prompt_tokens, output_tokens) pairs from the workload's mix, drawn from `rng`."""
    if w.length_mix == "fixed":
        return [(w.prompt_tokens, w.output_tokens)] * count
    if w.length_mix == "trace":
        trace = read_trace(w.length_trace)
        return [trace[rng.randrange(len(trace))] for _ in range(count)]
    out = []
    for _ in range(count):
        prompt = _draw(w.prompt_tokens_mix, w.length_mix, rng) if w.prompt_tokens_mix else w.prompt_tokens
        output = _draw(w.output_tokens_mix, w.length_mix, rng) if w.output_tokens_mix else w.output_tokens
        out.append((max(1, prompt), max(1, output)))
    return out


def check_mix(kind: str, spec: tuple[float, ...]) -> str:
    """"" when `spec` is a valid parameter list of mix `kind`, else what is wrong with it."""
    if kind == "uniform":
        if len(spec) != 2 or not 1 <= spec[0] <= spec[1]:
            return f"uniform takes [low, high] with 1 <= low <= high, got {list(spec)}"
    elif kind == "normal":
        if len(spec) not in (2, 4) or spec[1] < 0 or (len(spec) == 4 and not 1 <= spec[2] <= spec[3]):
            return (f"normal takes [mean, sd] or [mean, sd, low, high] (clipped to low-high, "
                    f"1 <= low <= high), got {list(spec)}")
    elif spec:
        return (f"is read only by a uniform or normal length_mix, and length_mix is {kind!r} "
                f"(set length_mix = \"uniform\" or \"normal\", or remove it)")
    return ""
