"""The live progress of a run on stderr: launches done and to go, the ETA, and the current phase."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import Callable, TextIO

# How a load level's name reads in the status line.
PHASE_NAMES = {"warmup": "warm-up"}


def phase_label(name: str) -> str:
    """'warmup' -> 'warm-up', 'c16' -> 'level c16'; the run's own phases (launching, ...) as they are."""
    if name in PHASE_NAMES:
        return PHASE_NAMES[name]
    if name in ("launching", "stopping", "building prompts") or name.startswith("building prompts "):
        return name
    return f"level {name}"


class RunProgress:
    """One status line for a run: redrawn in place on a terminal (and every `tick_s` while a
    launch waits), one plain line per phase otherwise. Log lines print above it."""

    def __init__(self, target: int, done: int = 0, stream: TextIO | None = None,
                 enabled: bool = True, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, tick_s: float | None = 1.0):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and (self.stream.isatty() if tty is None else tty)
        self.clock = clock
        self.target, self.done_before = target, done
        self.started = clock()
        self.trial: int | None = None
        self.launch: int | None = None      # this launch's count towards the target; None: relaunch
        self.what = ""                       # "" or e.g. "replicate 1/1"
        self.phase = ""
        self.phase_started = self.trial_started = self.started
        self.detail = ""
        self.per_launch_s: float | None = None
        self.lock = threading.RLock()
        self.shown = False                   # a status line is on screen (tty)
        self._stop = threading.Event()
        self._ticker = None
        if self.tty and tick_s:
            self._ticker = threading.Thread(target=self._tick, args=(tick_s,), daemon=True)
            self._ticker.start()

    # -- what the run tells it

    def begin(self, trial: int, launch: int | None = None, what: str = "",
              flags: str = "") -> None:
        """A launch of `trial` starts: the `launch`-th towards the target, or a relaunch (`what`).
        One line that stays names it and its flags; the status line then says `launching`."""
        with self.lock:
            now = self.clock()
            if launch is not None:
                finished = launch - 1 - self.done_before   # launches this run finished so far
                if finished > 0:
                    self.per_launch_s = (now - self.started) / finished
            self.trial, self.launch, self.what = trial, launch, what
            self.trial_started = now
            self.log(f"{self.head()} {flags}".rstrip())
            self.phase, self.phase_started, self.detail = "launching", now, ""
            if self.tty:
                self._draw()

    def set_phase(self, name: str) -> None:
        with self.lock:
            self._phase(phase_label(name), self.clock())

    def requests(self, text: str) -> None:
        """The load level's own figures (requests done, tok/s), shown after the phase."""
        with self.lock:
            self.detail = text
            if self.tty:
                self._draw()

    def log(self, message: str) -> None:
        """A line that stays (above the status line on a terminal)."""
        with self.lock:
            if self.shown:
                self.stream.write("\r\x1b[K")
            self.stream.write(message + "\n")
            if self.shown:
                self._draw()
            self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            if self.shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self.shown = False

    # -- what it shows

    def eta_s(self) -> float | None:
        """Seconds until the target is reached, from the mean launch time of this run so far."""
        if self.per_launch_s is None or self.launch is None:
            return None
        left = self.target - self.launch + 1          # this launch included
        in_this = self.clock() - self.trial_started
        return max(self.per_launch_s * (left - 1), self.per_launch_s * left - in_this)

    def eta_text(self) -> str:
        eta = self.eta_s()
        if eta is None:
            return ""
        return f" | ETA {eta / 60:.0f} min" if eta >= 60 else f" | ETA {eta:.0f} s"

    def head(self) -> str:
        """[trial 3 | launch 2/10: 1 done, 9 to go | ETA 12 min]"""
        done = (self.launch - 1) if self.launch is not None else None
        if self.launch is not None:
            count = f"launch {self.launch}/{self.target}: {done} done, {self.target - done} to go"
        else:
            count = self.what or "relaunch"
        trial = f"trial {self.trial} | " if self.trial is not None else ""
        return f"[{trial}{count}{self.eta_text()}]"

    def line(self) -> str:
        seconds = self.clock() - self.phase_started
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.head()} {self.phase}{detail} ({seconds:.0f} s)"

    # -- internals

    def _phase(self, label: str, now: float) -> None:
        if label == self.phase and now - self.phase_started < 1e-9:
            return
        self.phase, self.phase_started, self.detail = label, now, ""
        if not self.enabled:
            return
        if self.tty:
            self._draw()
        else:
            self.stream.write(f"{self.head()} {label}\n")
            self.stream.flush()

    def _width(self) -> int:
        """The terminal's width (stderr's own: stdout may be a pipe); a longer line would wrap,
        and \r would then redraw only its last row."""
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        return columns or shutil.get_terminal_size((120, 24)).columns   # 0: size not set

    def _draw(self) -> None:
        width = self._width()
        self.stream.write("\r\x1b[K" + self.line()[:max(20, width - 1)])
        self.stream.flush()
        self.shown = True

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every):
            with self.lock:
                if self.shown:
                    self._draw()


class RequestProgress:
    """A load level's requests done and tok/s: in the run's status line when a run shows one,
    else its own \\r-updated line on a terminal, a few plain lines otherwise."""

    def __init__(self, name: str, total: int, enabled: bool, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.perf_counter, seconds: float = 0.0):
        # seconds: a level with a time floor, whose request count is known only at its end: its
        # progress is told in seconds run, and `total` is the floor of requests
        self.name, self.total, self.enabled = name, total, enabled and total > 0
        self.seconds = seconds
        self.stream = stream or sys.stderr
        self.clock = clock
        self.run = current() if self.enabled else None
        self.tty = self.enabled and self.stream.isatty()
        self.done = self.tokens = 0
        self.t0 = clock()
        self.last_write = 0.0
        self.next_mark = 1
        if self.run is not None:
            self.run.set_phase(name)

    def add(self, r) -> None:
        self.done += 1
        self.tokens += r.output_tokens
        if not self.enabled:
            return
        now = self.clock()
        if self.tty:
            if now - self.last_write >= 0.2 or self.done == self.total:
                self.last_write = now
                if self.run is not None and self.run.tty:
                    self.run.requests(self._figures(now))
                else:
                    self.stream.write("\r" + self._line(now))
                    self.stream.flush()
        elif self._share(now) >= self.next_mark / 4:
            while self._share(now) >= self.next_mark / 4:
                self.next_mark += 1
            self.stream.write(self._line(now) + "\n")
            self.stream.flush()

    def _share(self, now: float) -> float:
        """How far the level is: the smaller of its requests and its seconds against their floors."""
        share = self.done / self.total
        return min(share, (now - self.t0) / self.seconds) if self.seconds > 0 else share

    def _figures(self, now: float) -> str:
        # the level so far, ramp-up included: the figure kept is its steady window's (trials.csv
        # holds both: throughput_tok_s and throughput_tok_s_wall)
        rate = self.tokens / max(now - self.t0, 1e-9)
        if self.seconds > 0:
            return (f"{self.done} requests (at least {self.total}), {now - self.t0:.0f}/{self.seconds:g} s, "
                    f"{rate:,.0f} tok/s wall-clock")
        return f"{self.done}/{self.total} requests, {rate:,.0f} tok/s wall-clock"

    def _line(self, now: float) -> str:
        return f"{self.name}: {self._figures(now)}"

    def close(self) -> None:
        if self.tty and not (self.run is not None and self.run.tty):
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------- the run being shown

_current: RunProgress | None = None


def current() -> RunProgress | None:
    return _current


def start(target: int, done: int = 0, enabled: bool = True, **kwargs) -> RunProgress:
    """Show a run's progress from now on (`done` launches were finished before it started)."""
    global _current
    stop()
    _current = RunProgress(target, done, enabled=enabled, **kwargs)
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
    _current = None


def begin(trial: int, launch: int | None = None, what: str = "", flags: str = "") -> None:
    """A launch starts (see RunProgress.begin); without a run shown, just its line."""
    if _current is not None:
        _current.begin(trial, launch, what, flags)
    else:
        count = f"launch {launch}" if launch is not None else (what or "relaunch")
        log(f"[trial {trial} | {count}] {flags}".rstrip())


def phase(name: str) -> None:
    """The current launch moved on (launching, building prompts, warm-up, level cN, stopping)."""
    if _current is not None:
        _current.set_phase(name)


def log(message: str, stream: TextIO | None = None) -> None:
    """One line on stderr that stays, printed above the live status line when there is one."""
    if _current is not None and stream is None:
        _current.log(message)
    else:
        s = stream or sys.stderr
        s.write(message + "\n")
        s.flush()
