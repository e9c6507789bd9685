"""The exception types user-facing code raises for bad input and for a lost peer; the CLI prints each as
one line. Also the argument parser of every command, whose usage errors are such an exception."""

import argparse
import typing


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the valid choices."""


class CollectiveError(RuntimeError):
    """A collective of the process group failed on this rank: it waited past ``dist_timeout`` for another
    rank (stuck, or busy elsewhere), or another rank's process went away. Every waiting rank raises it within
    the timeout instead of hanging; the message names the rank and the cause."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are a ConfigError: one ``error:`` line and exit 2 like all bad input
    (argparse's own error() prints the usage block too, and exits from inside the parse)."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")
