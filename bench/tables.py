"""The figures and Markdown tables every report of the bench writes, in one leaf module.

The run's report and the in-process measurements both format with these, so
neither has to import the other.
"""

from __future__ import annotations

import numpy as np


def summary(values) -> dict | None:
    v = np.array([x for x in values if x is not None], dtype=float)
    if not len(v):
        return None
    percentiles = {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}
    return {"n": int(len(v)), **percentiles, "max": float(v.max()), "mean": float(v.mean())}


def stat(values, *keys: str) -> list[float | None]:
    """Those figures of ``values``' summary (None where there are no values)."""
    s = summary(values)
    return [None if s is None else s[k] for k in keys]


def fmt(x: float | None) -> str:
    if x is None:
        return "–"
    a = abs(x)
    return f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1 else f"{x:.3f}"


def table(header: str, rows: list[list[str]]) -> str | None:
    """A Markdown table; ``header``'s columns are separated by ``|``. None without rows: the report
    leaves out the section of a measurement the run did not make."""
    if not rows:
        return None
    columns = header.split("|")
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
