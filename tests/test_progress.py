"""The live progress of a run: one status line redrawn on a terminal, plain lines otherwise."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest

from fakes import FakeCurveDevice, fake_config
from tuner import progress
from tuner.load.client import Workload, run_load_test
from tuner.records import RequestResult

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def screen(text: str) -> list[str]:
    """The lines a terminal shows after `text`: \r returns to the line's start, ESC[K clears
    from the cursor to the line's end, other text overwrites from the cursor."""
    lines, line, col = [], [], 0
    for part in re.split(r"(\r|\n|\x1b\[K)", text):
        if part == "\n":
            lines.append("".join(line))
            line, col = [], 0
        elif part == "\r":
            col = 0
        elif part == "\x1b[K":
            del line[col:]
        elif part:
            line[col:col + len(part)] = part
            col += len(part)
    lines.append("".join(line))
    return lines


def test_terminal_shows_one_status_line_redrawn_in_place():
    clock, out = Clock(), Terminal()
    bar = progress.RunProgress(3, stream=out, clock=clock, tick_s=None)
    bar.begin(0, 1, flags="--max-num-seqs 4")
    assert screen(out.getvalue()) == ["[trial 0 | launch 1/3: 0 done, 3 to go] --max-num-seqs 4",
                                      "[trial 0 | launch 1/3: 0 done, 3 to go] launching (0 s)"]
    clock.now += 25
    bar.set_phase("warmup")
    clock.now += 5
    bar.set_phase("c16")
    clock.now += 3
    bar.requests("12/64 requests, 1,234 tok/s")
    shown = screen(out.getvalue())
    assert len(shown) == 2   # redrawn in place: no new line per phase
    assert shown[-1] == "[trial 0 | launch 1/3: 0 done, 3 to go] level c16: 12/64 requests, 1,234 tok/s (3 s)"
    bar.log("  trial 0: single-stream 100.0 tok/s")
    shown = screen(out.getvalue())
    assert shown[1:] == ["  trial 0: single-stream 100.0 tok/s",   # a log line stays above
                         "[trial 0 | launch 1/3: 0 done, 3 to go] level c16: 12/64 requests, "
                         "1,234 tok/s (3 s)"]
    clock.now += 27     # the first launch took 60 s: two to go take about 2 minutes
    bar.begin(1, 2, flags="--max-num-seqs 16")
    assert screen(out.getvalue())[-1] == ("[trial 1 | launch 2/3: 1 done, 2 to go | ETA 2 min] "
                                          "launching (0 s)")
    clock.now += 50     # the ETA counts down during the launch, not below the launches after it
    assert bar.eta_s() == pytest.approx(70)
    clock.now += 30
    assert bar.eta_s() == pytest.approx(60)
    bar.set_phase("stopping")
    assert screen(out.getvalue())[-1].startswith("[trial 1 | launch 2/3: 1 done, 2 to go | ETA 1 min] stopping")
    bar.close()
    assert screen(out.getvalue())[-1] == ""       # the status line is cleared at the end


def test_not_a_terminal_gives_plain_lines():
    clock, out = Clock(), io.StringIO()
    bar = progress.RunProgress(2, done=1, stream=out, clock=clock, tick_s=None)
    bar.begin(5, 2, flags="--max-num-seqs 4")
    bar.set_phase("warmup")
    bar.requests("1/2 requests")           # figures are the load level's own lines here
    bar.set_phase("single_stream")
    bar.set_phase("stopping")
    bar.log("  trial 5: ok")
    bar.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == ["[trial 5 | launch 2/2: 1 done, 1 to go] --max-num-seqs 4",
                                 "[trial 5 | launch 2/2: 1 done, 1 to go] warm-up",
                                 "[trial 5 | launch 2/2: 1 done, 1 to go] level single_stream",
                                 "[trial 5 | launch 2/2: 1 done, 1 to go] stopping",
                                 "  trial 5: ok"]


def test_a_relaunch_names_itself_and_keeps_the_count_out():
    out = io.StringIO()
    bar = progress.RunProgress(4, stream=out, clock=Clock(), tick_s=None)
    bar.begin(0, what="replicate 1/2", flags="--max-num-seqs 8")
    assert out.getvalue().splitlines() == ["[trial 0 | replicate 1/2] --max-num-seqs 8"]


def test_load_levels_report_their_phase_and_requests(monkeypatch):
    """A real load test (in-process server) moves the status line through every level."""
    from test_loadgen import MODEL, FakeVLLM

    out = Terminal()
    monkeypatch.setattr(sys, "stderr", out)      # the request counter's stream
    seen = []
    bar = progress.start(1, stream=out, tick_s=None)
    original = bar._phase
    monkeypatch.setattr(bar, "_phase", lambda label, now: (seen.append(label), original(label, now)))
    server = FakeVLLM()
    try:
        w = Workload(prompt_tokens=8, output_tokens=4, warmup_requests=2, single_stream_requests=2,
                     throughput_requests=8, levels=(4,))
        bar.begin(0, 1)
        run_load_test(server.base_url, MODEL, w)
    finally:
        server.close()
        progress.stop()
    assert seen == ["building prompts", "warm-up", "level single_stream", "level c4", "stopping"]
    assert "level c4: 16/16 requests" in out.getvalue()
    assert screen(out.getvalue())[-1] == ""


def test_request_progress_without_a_run_keeps_its_own_lines(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    bar = progress.RequestProgress("c4", 4, True)
    for _ in range(4):
        bar.add(RequestResult(ok=True, output_tokens=8))
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["c4: 1/4 requests", "c4: 2/4 requests",
                                                      "c4: 3/4 requests", "c4: 4/4 requests"]


def test_a_level_with_a_time_floor_tells_its_seconds(monkeypatch):
    # a floor of 4 requests and 8 s: marks at a quarter of whichever floor is further from met
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    now = [0.0]
    bar = progress.RequestProgress("c4", 4, True, clock=lambda: now[0], seconds=8.0)
    for t in (0.5, 1.0, 2.5, 4.5, 6.5, 8.5):   # requests keep coming until the 8 s are run
        now[0] = t
        bar.add(RequestResult(ok=True, output_tokens=8))
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(",")[1].strip() for line in lines] == ["2/8 s", "4/8 s", "6/8 s", "8/8 s"]
    assert lines[-1].startswith("c4: 6 requests (at least 4)")


def test_run_prints_launch_counts_and_eta(tmp_path, capsys):
    from tuner.search.study import Tuner
    from fakes import FAKE_PLATFORM

    cfg = fake_config(tmp_path)
    Tuner(cfg, measure=FakeCurveDevice(), platform=FAKE_PLATFORM, progress=True).run(3)
    err = capsys.readouterr().err
    heads = re.findall(r"^\[trial \d+ \| launch (\d)/3: (\d) done, (\d) to go( \| ETA \d+ s)?\]",
                       err, re.M)
    assert [(k, d, g) for k, d, g, _ in heads] == [("1", "0", "3"), ("2", "1", "2"), ("3", "2", "1")]
    assert heads[0][3] == "" and heads[1][3] and heads[2][3]   # an ETA once a launch is timed
    assert progress.current() is None                           # the run took its display down


def test_run_in_a_real_terminal_redraws_and_clears(tmp_path):
    """`run`'s stderr on a pseudo-terminal: the status line is drawn with \\r ESC[K and cleared."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from pathlib import Path
        from fakes import FAKE_PLATFORM, FakeCurveDevice, fake_config
        from tuner.search.study import Tuner
        device = FakeCurveDevice(during=lambda n: time.sleep(1.5))   # the ticker redraws meanwhile
        Tuner(fake_config(Path({str(tmp_path)!r})), measure=device, platform=FAKE_PLATFORM).run(2)
    """)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # 100 columns
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=slave, env=env, cwd=tmp_path)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            pytest.fail("no output from the run for 120 s")
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(60) == 0
    os.close(master)
    text = b"".join(chunks).decode().replace("\r\n", "\n")
    assert "\r\x1b[K[trial 0 | launch 1/2: 0 done, 2 to go] launching (1 s)" in text
    shown = [line for line in screen(text) if line]
    assert shown[-1].startswith("  trial ")   # the last thing left on screen is a log line
    assert not any("launching (" in line for line in shown)   # no status line left behind
    assert max(len(line) for line in re.split(r"[\r\n]", text) if "launching (" in line) < 100
