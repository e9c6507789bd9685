"""The one exception type user-facing code raises for bad input; the CLI prints it as one line."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the valid choices."""
