"""The machine the benchmark runs on: what it is, how loaded it was, and the CPU time
other work took from it while a scenario ran."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def machine() -> dict:
    cpu, virtual = "unknown", False
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                virtual = virtual or "hypervisor" in line.split()
    except OSError:
        pass
    return {
        "cpu": cpu,
        "virtual": virtual,
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def load_average() -> tuple[float, float, float]:
    """The machine's 1, 5 and 15 minute load averages: how busy the shared machine was."""
    one, five, fifteen = os.getloadavg()
    return (one, five, fifteen)


class CpuMeter:
    """CPU time used on the whole machine, and by the benchmark's own processes (client and
    servers): the difference is what other work took from the cores while a scenario ran."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")

    def read(self) -> tuple[float, float, float]:
        """(wall s, machine busy s, our processes' s)."""
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy.
        busy = sum(fields) - fields[3] - fields[4]
        ours = 0
        for pid in self.pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            # Fields after the parenthesised command name; utime and stime are the 12th and 13th.
            rest = stat.rsplit(")", 1)[1].split()
            ours += int(rest[11]) + int(rest[12])
        return time.monotonic(), busy / self.tick, ours / self.tick

    def usage_since(self, before: tuple[float, float, float]) -> dict:
        """Average cores busy since ``before``: in total, by our processes, by everything else."""
        wall, busy, ours = (now - then for now, then in zip(self.read(), before))
        wall = max(wall, 1e-9)
        return {
            "wall_s": wall,
            "machine_cores": busy / wall,
            "bench_cores": ours / wall,
            "other_cores": max(0.0, busy - ours) / wall,
        }
