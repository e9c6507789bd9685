"""The exception types user-facing code raises for bad input and for a lost peer; the CLI prints each as
one line."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the valid choices."""


class CollectiveError(RuntimeError):
    """A collective of the process group failed on this rank: it waited past ``dist_timeout`` for another
    rank (stuck, or busy elsewhere), or another rank's process went away. Every waiting rank raises it within
    the timeout instead of hanging; the message names the rank and the cause."""
