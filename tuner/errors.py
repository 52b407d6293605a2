"""Exceptions of the tuner: each carries its data and writes its own one-line message."""


class TunerError(Exception):
    """A problem a person can fix (bad input, missing engine, unwritable folder).

    `cli.py` prints `str(err)` as one line and exits with code 2.
    """


class ConfigError(TunerError):
    """A study file or command-line value is wrong: names the file, the key and the fix."""

    def __init__(self, source: str, key: str, problem: str, fix: str = ""):
        self.source, self.key, self.problem, self.fix = source, key, problem, fix
        where = f"{source}: {key}" if key else source
        text = f"{where}: {problem}"
        if fix:
            text += f" ({fix})"
        super().__init__(text)


class CheckpointError(TunerError):
    """The study's model cannot be had: names the model, what is wrong and the fix."""

    def __init__(self, model: str, problem: str, fix: str = ""):
        self.model, self.problem, self.fix = model, problem, fix
        text = f"model {model!r}: {problem}"
        if fix:
            text += f" ({fix})"
        super().__init__(text)


class ModelNotFound(CheckpointError):
    """No such folder, no such hub repository, or a folder that is not a model."""


class HubUnreachable(CheckpointError):
    """A hub id that is not in the local cache while the hub cannot be reached (offline)."""
