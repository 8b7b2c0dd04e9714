"""Quiet abandoned reads: drop orbax's late reports of the reads it gave up after one failed."""

from __future__ import annotations

import gc
import logging
import os
import sys


def _from_orbax_internals(exc: BaseException | None) -> bool:
    """True if ``exc`` (or an exception it came from) was raised inside orbax or asyncio."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if f"{os.sep}orbax{os.sep}" in name or f"{os.sep}asyncio{os.sep}" in name:
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


def _never_retrieved(record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in str(record.msg)


class QuietAbandonedReads:
    """When one read of a damaged checkpoint fails, orbax abandons the others: they raise later
    into its closed event loop, or when their coroutines are collected, and Python prints each as
    "Exception ignored in ..." at some later moment. The failure is reported once, by the
    caller; while this context is active (and, after a failure, until the abandoned coroutines
    and futures are collected on exit) these reports of the same failure are dropped (also
    asyncio's "exception was never retrieved" log lines); others pass through.

    Set ``failed`` to true when a read failed, so that the abandoned reads are collected on exit.
    """

    def __init__(self):
        self.failed = False

    def __enter__(self):
        self._previous = previous = sys.unraisablehook

        def hook(unraisable):
            if not _from_orbax_internals(unraisable.exc_value):
                previous(unraisable)

        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_never_retrieved)
        return self

    def __exit__(self, *exc):
        try:
            if self.failed:
                gc.collect()
        finally:
            sys.unraisablehook = self._previous
            logging.getLogger("asyncio").removeFilter(_never_retrieved)
        return False
