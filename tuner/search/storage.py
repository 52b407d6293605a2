"""The study's Optuna storage: opening it (heartbeats for shared studies), the lock that keeps two
workers off one config, the retry of a dead worker's trial, and loading an existing study."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
import warnings
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial

from tuner import progress
from tuner.config import StudyConfig
from tuner.errors import TunerError

# Many workers on one study (`run --parallel N`, or hosts sharing a PostgreSQL storage): each
# RUNNING trial beats its heart this often, and one silent this long is failed and queued again
# once by whichever worker notices (a worker on its own host notices a dead one at once, by pid).
HEARTBEAT_INTERVAL_S = 10
HEARTBEAT_GRACE_S = 60


def open_storage(url: str, shared: bool = False) -> optuna.storages.BaseStorage:
    """The study's RDB storage; `shared` (several workers on it): with Optuna's heartbeat, so a
    trial whose worker died is failed and queued again once, and SQLite waits for its lock."""
    kwargs: dict = {}
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///"):])
        if not db.parent.exists():
            try:
                db.parent.mkdir(parents=True)
            except OSError as e:
                raise TunerError(f"storage {url} cannot be opened: {e.strerror}: pass --storage URL")
        if shared:   # writers queue for SQLite's one lock instead of failing with "database is locked"
            kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    if shared:
        kwargs.update(heartbeat_interval=HEARTBEAT_INTERVAL_S, grace_period=HEARTBEAT_GRACE_S,
                      heartbeat_stale_trial_callback=RequeueOnce())
    try:
        with quiet_experimental():   # the heartbeat is an "experimental" Optuna argument
            return optuna.storages.RDBStorage(url, **kwargs)
    except Exception as e:  # SQLAlchemy raises many kinds; all mean "this URL does not work"
        reason = str(e).splitlines()[0][:200]
        raise TunerError(f"storage {url} cannot be opened ({type(e).__name__}: {reason}): "
                         "pass --storage URL (e.g. sqlite:///studies/NAME.db)")


def check_storage(url: str) -> str:
    """What `doctor` says of the storage, creating nothing: a SQLite file that does not exist yet
    is checked by its folder (the first `run` creates it); any other URL is opened."""
    import tempfile

    db = Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None
    if db is not None and not db.exists():
        folder = db.resolve().parent
        while not folder.exists():
            folder = folder.parent
        try:   # a file that vanishes once closed: the one way to know, as root too
            tempfile.TemporaryFile(dir=folder).close()
        except OSError:
            raise TunerError(f"storage {url} cannot be created: {folder} is not writable: "
                             "pass --storage URL") from None
        return "ok (the first run creates it)"
    open_storage(url)
    return "ok"


@contextlib.contextmanager
def quiet_experimental():
    """Optuna's heartbeat and retry API without its ExperimentalWarning on every use."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


class RequeueOnce(optuna.storages.RetryHeartbeatStaleTrialCallback):
    """A trial whose worker died is queued again once, by Optuna's retry convention (system attrs
    `failed_trial` and `retry_history`), carrying only its baseline attrs: the dead worker's pid,
    host and server pgid would make the retry look like that worker's trial, which the sweep for
    dead workers would then fail again."""

    def __init__(self) -> None:
        with quiet_experimental():
            super().__init__(max_retry=1)

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        kept = copy.copy(trial)
        kept._user_attrs = {k: v for k, v in trial.user_attrs.items() if k.startswith("baseline")}
        kept._system_attrs = {k: v for k, v in trial.system_attrs.items()
                              if k in ("failed_trial", "retry_history")}
        with quiet_experimental():
            super().__call__(study, kept)


@contextlib.contextmanager
def study_lock(storage, url: str, name: str):
    """One worker at a time decides what to launch (the budget left, the configs in flight):
    PostgreSQL's advisory lock on the study, or an flock on a file beside an SQLite database. Both
    are let go when their holder dies. Other storages: no lock (a race costs one extra launch)."""
    if url.startswith("sqlite:///"):
        import fcntl

        with open(url[len("sqlite:///"):] + ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    elif url.startswith("postgresql") and hasattr(storage, "engine"):
        from sqlalchemy import text

        key = int.from_bytes(hashlib.sha256(f"tuner:{name}".encode()).digest()[:8], "big", signed=True)
        with storage.engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
    else:
        yield


class Heartbeat:
    """Record a trial's heartbeat every HEARTBEAT_INTERVAL_S while its worker works on it."""

    def __init__(self, storage, trial_id: int):
        self.storage, self.trial_id = storage, trial_id
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True, name=f"heartbeat-{trial_id}")

    def _beat(self) -> None:
        while True:
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception as e:  # a storage hiccup must not kill the trial: the next beat may pass
                progress.log(f"  heartbeat of trial id {self.trial_id} not recorded: {type(e).__name__}")
            if self.stop.wait(self.storage.get_heartbeat_interval()):
                return

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def load_existing(cfg: StudyConfig) -> optuna.Study:
    db = cfg.storage[len("sqlite:///"):].split("?")[0] if cfg.storage.startswith("sqlite:///") else ""
    if db and db != ":memory:" and not Path(db).exists():   # opening it would create an empty one
        beside = Path(cfg.source).parent / Path(db).name
        if not Path(db).is_absolute() and beside.exists() and Path(cfg.source).exists():
            # the default storage is relative to the folder the tuner runs in, like results/
            raise TunerError(f"no study {cfg.name!r} in {cfg.storage} (no such file under "
                             f"{Path.cwd()}); {beside} is beside the study file: run from the folder "
                             f"that holds {Path(db).parent}/, or pass --storage "
                             f"sqlite:///{beside.resolve()}")
        raise TunerError(f"no study {cfg.name!r} in {cfg.storage} (no such file): run "
                         "`python -m tuner run` first")
    storage = open_storage(cfg.storage)
    try:
        return optuna.load_study(study_name=cfg.name, storage=storage)
    except KeyError:
        names = optuna.get_all_study_names(storage)
        held = (f"; it holds {', '.join(repr(n) for n in names[:8])}{' ...' if len(names) > 8 else ''}"
                " (--name NAME reads one)" if names else "")
        raise TunerError(f"no study {cfg.name!r} in {cfg.storage}{held}: run `python -m tuner run` first"
                         if not names else f"no study {cfg.name!r} in {cfg.storage}{held}")
