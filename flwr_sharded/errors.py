"""Errors shared by every layer (imported by `config`, `parallel`, `training`, `flower` and `perf` alike)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option and what it accepts."""
