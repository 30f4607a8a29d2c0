"""Errors that tidal raises for the user to act on."""

CONFIG_ERROR_EXIT = 2  # the exit code of a process stopped by its configuration: the same command fails again


class ConfigError(ValueError):
    """A configuration is invalid. The message names the key, the value and the rule."""
