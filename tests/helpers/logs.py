# SPDX-License-Identifier: Apache-2.0
"""Capturing the records of vLLM's loggers in a test (they do not propagate to pytest's ``caplog``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class LogRecords(logging.Handler):
    """Collects the records of the logger it is attached to, from DEBUG on."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level=logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@contextlib.contextmanager
def captured(logger: logging.Logger) -> Iterator[LogRecords]:
    """A :class:`LogRecords` attached to ``logger`` (its level set to DEBUG) while the block runs."""
    handler = LogRecords()
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
