"""The machine's cores: how many this process may compute on, and how many the other
processes on the machine keep busy, which the scheduler leaves to them."""

from __future__ import annotations

import os
import time


def usable_cores() -> int:
    """The cores this process may run on: a generation's compute threads unless told otherwise
    (the scheduler shares them among the generations running together)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class MachineLoad:
    """How many cores the other processes on this machine kept busy lately: the
    machine's busy CPU time (``/proc/stat``) minus this process's own, over the time
    between two looks. ggml's threads spin while they wait for each other, so a
    generation given more threads than the cores left to it runs several times
    slower than on one thread."""

    def __init__(self) -> None:
        self._last = _cpu_sample()
        self._others = 0.0

    def others(self) -> float:
        """Look again (if the last look is old enough to measure anything) and return the
        cores the other processes kept busy since the look before."""
        now = _cpu_sample()
        wall = now[0] - self._last[0]
        if wall < LOOK_MIN_S:
            return self._others
        # A longer gap (this process was stopped, or starved of a core) says nothing
        # about now: keep the last figure until the next look.
        if wall <= LOOK_MAX_S:
            machine, own = now[1] - self._last[1], now[2] - self._last[2]
            self._others = max(0.0, (machine - own) / wall)
        self._last = now
        return self._others


def _cpu_sample() -> tuple[float, float, float]:
    """(wall clock, CPU seconds every process used, CPU seconds this one used)."""
    times = os.times()
    return time.monotonic(), _machine_busy_seconds(), times.user + times.system


def _machine_busy_seconds() -> float:
    # user, nice, system, idle, iowait, irq, softirq, steal: busy is all but idle,
    # iowait and steal (which another virtual machine took). Zero where there is
    # no /proc: every core then counts as free.
    try:
        with open("/proc/stat", "rb") as stat:
            line = stat.readline()
    except OSError:
        return 0.0
    return busy_seconds(line, niced=_NICED)


def busy_seconds(cpu_line: bytes, niced: bool) -> float:
    """The busy CPU seconds in /proc/stat's ``cpu`` line. Work at a lowered priority (nice: a
    batch job, a benchmark's own client) gives way to this process's, so its cores are ours to
    take; unless this process runs ``niced`` too, when its own time is counted there and those
    processes are its equals."""
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in cpu_line.split()[1:8])
    return (user + (nice if niced else 0) + system + irq + softirq) / _CLOCK_TICKS


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_NICED = hasattr(os, "nice") and os.nice(0) > 0

# The machine's load is looked at this often while generations run, and the cores
# reshared; a look measures at least LOOK_MIN_S and at most LOOK_MAX_S.
LOOK_INTERVAL_S = 0.5
LOOK_MIN_S = 0.2
LOOK_MAX_S = 2.0
