"""Ending asyncio tasks for certain."""

from __future__ import annotations

import asyncio

# A task being stopped that is still running this long after its cancel is cancelled again.
RECANCEL_S = 0.1


async def stop_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait until every one has ended.

    A cancel alone may not end a task that uses Redis: on Python 3.11, a cancel that lands as the client
    finishes sending a command is lost (the client sends through asyncio.wait_for, which then returns
    instead of raising: CPython gh-86296, fixed in 3.12), and the task goes on. So a task still running
    RECANCEL_S after its cancel is cancelled again. A caller cancelled meanwhile still waits for them all,
    then is cancelled: no task is left running."""
    pending = {task for task in tasks if not task.done()}
    interrupted = False
    while pending:
        for task in pending:
            task.cancel()
        try:
            _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
        except asyncio.CancelledError:
            interrupted = True
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved, as gather(return_exceptions=True) would: its owner has seen to it
    if interrupted:
        raise asyncio.CancelledError
