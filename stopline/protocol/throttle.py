"""Answering a flood without becoming one: a warning (a log line, an error frame) that
each event of a flood would repeat is written at most once an interval, and carries
the running total of what it counts. Pure: the caller says what time it is."""

from __future__ import annotations

import math


class Throttle:
    """Whether the throttled warning may be written at ``now_s`` (any monotonic clock, in seconds)."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._written_at = -math.inf

    def due(self, now_s: float, *, always: bool = False) -> bool:
        if always or now_s - self._written_at >= self.interval_s:
            self._written_at = now_s
            return True
        return False
