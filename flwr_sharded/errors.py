"""Errors shared by every layer (imported by `config`, `parallel`, `training`, `flower` and `perf` alike)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option and what it accepts."""


def first_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (a gloo error's carries the cause)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
