"""A smaller card, emulated for real: a process that holds all the device's free memory but the
budget, for as long as one server runs.

A memory budget alone (`memory_budget_mode = "share"`) scales --gpu-memory-utilization so that
vLLM plans within the budget. That covers what vLLM plans (the weights, the profiled activations,
the KV cache) but not a peak outside the plan, such as weights loaded before they are offloaded.
The ballast (`memory_budget_mode = "ballast"`) takes the rest of the card before the server
starts. Then only the budget is free, as on the real card: a peak above it fails with CUDA's own
out-of-memory error, and the trial is classified like any OOM.

    with Ballast(leave_bytes=int(15.77 * 2**30), env=spec.env) as ballast:
        ...start the server, measure it...       # ballast.held_bytes: what the ballast took

The ballast runs in its own process group (stopped with the server's trial, and at exit by
`stop_all`) and also exits once its stdin closes, so it cannot outlive a tuner killed with SIGKILL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from tuner.errors import TunerError

CHUNK_BYTES = 1 << 30        # allocated a GiB at a time, then the remainder
READY_TIMEOUT_S = 120.0      # CUDA's initialisation and tens of GiB of allocations


def hold(leave_bytes: int, mem_get_info, allocate, chunk_bytes: int = CHUNK_BYTES) -> list:
    """Allocate until the device's free memory is `leave_bytes` (never below it): `mem_get_info()`
    gives (free, total) bytes, `allocate(n)` returns a block of n bytes. The blocks, to keep."""
    blocks = []
    while True:
        free, _ = mem_get_info()
        extra = free - leave_bytes
        if extra < (2 << 20):   # the allocator's granularity: closer than this is as close as it gets
            return blocks
        blocks.append(allocate(min(extra, chunk_bytes)))


def main(argv: list[str]) -> int:
    """The ballast process: `python -m tuner.run.ballast LEAVE_BYTES`."""
    import torch

    leave = int(argv[0])
    if not torch.cuda.is_available():
        print("error: no CUDA device visible to the ballast", flush=True)
        return 2
    try:
        blocks = hold(leave, torch.cuda.mem_get_info,
                      lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:   # something else took memory meanwhile
        print(f"error: {str(e).splitlines()[0]}", flush=True)
        return 3
    free, total = torch.cuda.mem_get_info()
    print(f"held {sum(b.numel() for b in blocks)} free {free} total {total}", flush=True)
    sys.stdin.read()   # until the tuner closes it: stopped, or dead
    return 0


class Ballast:
    """Hold all of the device's free memory but `leave_bytes` while the block runs (see module)."""

    def __init__(self, leave_bytes: int, env=(), cmd: tuple[str, ...] | None = None):
        self.leave_bytes = leave_bytes
        self.env = {**os.environ, **dict(env)}
        self.cmd = cmd or (sys.executable, "-m", "tuner.run.ballast")
        self.held_bytes: int | None = None
        self.free_bytes: int | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        from tuner.run import process

        self._proc = subprocess.Popen([*self.cmd, str(self.leave_bytes)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env=self.env, start_new_session=True, text=True)
        process.register_ballast(self)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(READY_TIMEOUT_S)
        said = (line[0] if line else "").strip()
        if not said.startswith("held "):
            self.stop()
            raise TunerError("the memory ballast did not take the device's memory"
                             + (f": {said}" if said else f" within {READY_TIMEOUT_S:.0f} s")
                             + " (memory_budget_mode = \"ballast\" needs torch with CUDA in the "
                               "tuner's Python)")
        words = said.split()
        self.held_bytes, self.free_bytes = int(words[1]), int(words[3])

    def stop(self) -> None:
        from tuner.run import process

        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        try:
            proc.stdin.close()
        except OSError:
            pass
        process.kill_group(proc.pid, 5.0)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        process.unregister_ballast(self)

    def __enter__(self) -> "Ballast":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
