"""Quiet abandoned reads: finish, and then drop the reports of, the reads orbax gives up after one failed."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import warnings

#: How long the reads a failed restore left behind may take to finish before they are cancelled.
DRAIN_SECONDS = 60.0


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


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when the coroutine it runs fails, first runs the tasks that coroutine
    left behind to their end (cancelling those still running after `DRAIN_SECONDS`).

    Orbax reads a checkpoint's arrays as many tasks on a loop of its own, gathered; when one read
    fails it closes that loop at once, with the others still waiting on TensorStore. Those then
    complete into the closed loop ("RuntimeError: Event loop is closed", from TensorStore's
    threads) or are destroyed unfinished ("coroutine ... was never awaited", "Exception ignored
    in ..."), each printed with its traceback at some later moment. Finishing them before the
    loop closes leaves nothing pending."""

    def run_until_complete(self, future):
        try:
            return super().run_until_complete(future)
        except BaseException:
            self._drain()
            raise

    def _drain(self) -> None:
        for _ in range(100):  # tasks may start others; each round waits for those left
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            if not pending:
                return
            done, late = super().run_until_complete(asyncio.wait(pending, timeout=DRAIN_SECONDS))
            for task in late:
                task.cancel()
            # Retrieves every exception, so none is reported as "never retrieved".
            super().run_until_complete(asyncio.gather(*done, *late, return_exceptions=True))


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        return _DrainingLoop()


class QuietAbandonedReads:
    """When one read of a damaged checkpoint fails, orbax abandons the others. While this context
    is active, event loops are created as :class:`_DrainingLoop` (for the reads orbax starts in
    this thread: the loop that failed finishes its abandoned reads before it closes). Any report
    of an abandoned read that still comes (raised into a closed event loop, or when a coroutine is
    collected: Python prints each as "Exception ignored in ...") repeats the failure the caller
    reports once, so it is dropped while this context is active and, after a failure, until the
    abandoned coroutines and futures are collected on exit (also asyncio's "exception was never
    retrieved" log lines); other reports pass through.

    Set ``failed`` to true when a read failed, so that the abandoned reads are collected on exit.
    """

    def __init__(self):
        self.failed = False

    def __enter__(self):
        self._policy = None
        if os.name == "posix" and type(asyncio.get_event_loop_policy()) is asyncio.DefaultEventLoopPolicy:
            with warnings.catch_warnings():  # the policy functions are deprecated from Python 3.14
                warnings.simplefilter("ignore", DeprecationWarning)
                self._policy = asyncio.get_event_loop_policy()
                asyncio.set_event_loop_policy(_DrainingPolicy())
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
            if self._policy is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    asyncio.set_event_loop_policy(self._policy)
        return False
