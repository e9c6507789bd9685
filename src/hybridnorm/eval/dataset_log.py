"""``datasets``' log while an lm-eval task's dataset loads, held back until the load ends: a load that fails
would otherwise print datasets' own lines ("Failed to load JSON from file ...") before the one ``error:`` line
that says the same. Scoped to the load: a load that succeeds passes every record on to datasets' handlers as
it would have (its warnings say something), and a load that fails puts its error records into the error,
where they name the file (the exception datasets raises names none)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def datasets_log_held() -> Iterator[None]:
    """Hold the records of the ``datasets`` logger (and its children) for the body. On success each is
    handled by datasets' own handlers afterwards; on an exception the records below ERROR are handled so,
    and the messages of the others are added to the exception's ``__notes__`` (PEP 678's place for them)."""
    import datasets.utils.logging  # noqa: F401  (configures datasets' handler first, which then stays)

    logger = logging.getLogger("datasets")
    held, handlers, propagate = _Held(), logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [held], False
    try:
        yield
    except BaseException as e:
        errors = [r for r in held.records if r.levelno >= logging.ERROR]
        held.records = [r for r in held.records if r.levelno < logging.ERROR]
        if errors:
            e.__notes__ = [*getattr(e, "__notes__", []), *(f"datasets: {r.getMessage()}" for r in errors)]
        raise
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        for record in held.records:
            logger.handle(record)
