"""Errors that tidal raises for the user to act on."""


class ConfigError(ValueError):
    """A configuration is invalid. The message names the key, the value and the rule."""
