"""Stands in for `python -m tuner.run.ballast LEAVE_BYTES` where there is no GPU: says what it
"held" (FAKE_BALLAST_SAY overrides the line), notes its pid in FAKE_BALLAST_PIDFILE, and waits for
its stdin to close, as the real ballast does."""

import os
import sys

leave = int(sys.argv[1])
if os.environ.get("FAKE_BALLAST_PIDFILE"):
    with open(os.environ["FAKE_BALLAST_PIDFILE"], "a") as f:
        f.write(f"{os.getpid()}\n")
print(os.environ.get("FAKE_BALLAST_SAY", f"held {80 * 2**30 - leave} free {leave} total {80 * 2**30}"),
      flush=True)
sys.stdin.read()
