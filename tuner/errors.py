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
