"""Errors that tidal raises for the user to act on."""

CONFIG_ERROR_EXIT = 2  # the exit code of a process stopped by its configuration: the same command fails again
# the trainer's exit code when trainer.batch_timeout_s passed without a batch: the rest of the job is starving
# it (no node alive or producing), which a restart of the trainer would only wait out again
NO_BATCH_EXIT = 3


class ConfigError(ValueError):
    """A configuration is invalid. The message names the key, the value and the rule."""
