"""Many workers on one study on this host: `run --parallel N` starts N worker processes, each with its GPU slot and port range, and stops what a dead one left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import TextIO

from tuner import progress
from tuner.config import StudyConfig
from tuner.errors import TunerError

FIRST_PORT = 20000        # below Linux's ephemeral range (32768-60999), where clients' ports come from
PORTS_PER_WORKER = 200
# options of the supervisor that its workers must not see again
OWN_OPTIONS = ("--parallel", "--gpus", "--first-worker")


def log(message: str) -> None:
    progress.log(message)


def parse_gpus(text: str | None) -> list[str]:
    """`--gpus 0,1` (NVML indices or GPU-/MIG- UUIDs, as CUDA_VISIBLE_DEVICES takes them)."""
    if text is None:
        return []
    slots = [g.strip() for g in text.split(",")]
    if any(not g for g in slots) or len(set(slots)) != len(slots):
        raise TunerError(f"--gpus {text!r}: give distinct GPUs separated by commas, e.g. --gpus 0,1")
    return slots


def check_gpus(slots: list[str]) -> None:
    """Each --gpus entry names one device NVML sees on this host, and no two the same device: a
    worker whose CUDA_VISIBLE_DEVICES named nothing would run vLLM's CPU build, or fail late."""
    from tuner.run import devices

    every = devices.all_gpus()
    text = ",".join(slots)
    if not every:
        raise TunerError(f"--gpus {text}: NVML sees no GPU on this host (no NVIDIA driver, or "
                         "pynvml missing): use --parallel N for workers without a GPU each")
    known = ", ".join(f"{g.index} ({g.name})" for g in every)
    taken: dict[tuple, str] = {}
    for slot in slots:
        v = devices.visibility({"CUDA_VISIBLE_DEVICES": slot})
        if len(v.devices) != 1:
            why = v.note.removeprefix(f"CUDA_VISIBLE_DEVICES entry {slot!r} ").split(":")[0]
            raise TunerError(f"--gpus {text}: {slot!r} {why or 'names no GPU'}; this host's GPUs "
                             f"are {known}")
        d = v.devices[0]
        if (d.index, d.mig_index) in taken:
            raise TunerError(f"--gpus {text}: {taken[d.index, d.mig_index]!r} and {slot!r} are the "
                             f"same GPU ({d.label}): one worker per GPU")
        taken[d.index, d.mig_index] = slot


def slot_label(index: int, gpu: str | None) -> str:
    """How a worker's lines are told apart on the supervisor's stderr: `[w1 gpu1] `, `[w0] `."""
    if gpu is None:
        return f"[w{index}] "
    return f"[w{index} gpu{gpu if len(gpu) <= 12 else gpu[:12] + '…'}] "


def forward_lines(stream: TextIO, label: str, out: TextIO, lock: threading.Lock) -> None:
    """Copy a worker's output to `out` line by line, each line behind its slot's label."""
    for line in iter(stream.readline, ""):
        with lock:
            out.write(label + line if line.endswith("\n") else label + line + "\n")
            out.flush()
    stream.close()


def worker_argv(argv: list[str], index: int, ports: range) -> list[str]:
    """The `run` command line of worker `index`: the user's, less the supervisor's own options."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in OWN_OPTIONS:
            skip = True
            continue
        if arg.split("=", 1)[0] in OWN_OPTIONS:
            continue
        out.append(arg)
    return out + ["--worker", str(index), "--ports", f"{ports.start}-{ports.stop - 1}", "--quiet"]


def worker_ports(slot: int) -> range:
    first = FIRST_PORT + slot * PORTS_PER_WORKER
    return range(first, first + PORTS_PER_WORKER)


def run(cfg: StudyConfig, argv: list[str], n_workers: int, n_trials: int, gpus: list[str],
        first_worker: int = 0):
    """Prepare the study once (create it, queue the baselines, stop what a killed run left), start
    the workers, and wait for them; when one dies, stop its server and queue its trial again (the
    others finish it). The study, once every worker has ended."""
    from tuner.results import report
    from tuner.search.study import Tuner

    if gpus and "CUDA_VISIBLE_DEVICES" in dict(cfg.env):
        raise TunerError("--gpus and the study's [server] env CUDA_VISIBLE_DEVICES both choose the "
                         "GPU: drop one")
    if gpus and len(gpus) != n_workers:
        raise TunerError(f"--parallel {n_workers} with {len(gpus)} GPUs (--gpus): one worker per GPU")
    if gpus:
        check_gpus(gpus)
    elif n_workers > 1:
        # no device of their own: the workers' servers and load tests run side by side on the same
        # device (or CPU cores), and each one's figures carry the others' load
        print(f"tuner: warning: --parallel {n_workers} without --gpus: the workers share this "
              "machine's device and cores, so each figure is measured beside another worker's "
              "server and load; give each its own GPU (--gpus 0,1) for figures a config alone "
              "would get", file=sys.stderr)
    tuner = Tuner(cfg, progress=False, worker=first_worker)
    study = tuner.open()
    workers: dict[int, subprocess.Popen] = {}
    readers: list[threading.Thread] = []
    out_lock = threading.Lock()
    for slot in range(n_workers):
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[slot]
        ports = worker_ports(slot)
        cmd = [sys.executable, "-m", "tuner", *worker_argv(argv, first_worker + slot, ports)]
        # its stdout and stderr come through here, so each line can say which worker wrote it
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        workers[proc.pid] = proc
        label = slot_label(first_worker + slot, gpus[slot] if gpus else None)
        reader = threading.Thread(target=forward_lines, args=(proc.stdout, label, sys.stderr, out_lock),
                                  daemon=True, name=f"worker-{first_worker + slot}-lines")
        reader.start()
        readers.append(reader)
        log(f"worker {first_worker + slot}: pid {proc.pid}"
            + (f", CUDA_VISIBLE_DEVICES={gpus[slot]}" if gpus else "")
            + f", ports {ports.start}-{ports.stop - 1}; its lines start {label.strip()}")
    codes: dict[int, int] = {}
    try:
        while len(codes) < len(workers):
            for pid, proc in workers.items():
                if pid in codes or proc.poll() is None:
                    continue
                codes[pid] = proc.returncode
                if proc.returncode != 0:
                    how = (f"killed by {signal.Signals(-proc.returncode).name}"
                           if proc.returncode < 0 else f"exit code {proc.returncode}")
                    log(f"worker pid {pid} ended ({how}): stopping its server, queueing its trial again")
                    tuner.recover_interrupted(study)
            time.sleep(0.2)
        for reader in readers:   # a worker's last lines (its error, say) before the summary
            reader.join(timeout=10)
    except KeyboardInterrupt:
        # Ctrl-C at a terminal reached the workers too; a SIGTERM to this process is passed on
        for pid, proc in workers.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in workers.values():
            proc.wait()
        for reader in readers:
            reader.join(timeout=10)
        tuner.recover_interrupted(study)
        report.write_all(study, cfg)
        raise
    report.write_all(study, cfg)
    failed = {pid: code for pid, code in codes.items() if code > 0}
    launched = tuner.launched_count(study)
    if launched < n_trials and failed:
        raise TunerError(f"{len(failed)} of {n_workers} workers stopped with an error (see their "
                         f"lines above); the study holds {launched} of {n_trials} launches: run the "
                         "same command again to go on")
    return study
