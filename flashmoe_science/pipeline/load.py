"""The machine's load around a stage, as env.json and bench.json record it:

    "load": {"cpus": 2, "before": [0.4, 0.3, 0.2], "after": [1.9, 0.8, 0.4]}

the CPU count and the load average (1, 5 and 15 minutes) when the stage started and when it ended;
null where the platform has no load average. A CPU benchmark whose 1-minute load average was above
the CPU count, before or after, shared its cores with other work: its timings are shown but not
judged (bench.md, the report). No torch here: env reads it too.
"""

from __future__ import annotations

import os
from typing import Any

RERUN = "rerun `nox -s bench` alone on an idle machine for judged numbers"


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, or None where the platform has none."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def start() -> dict:
    """The block at a stage's start; `finish` completes it."""
    return {"cpus": os.cpu_count(), "before": load_average(), "after": None}


def finish(block: dict) -> dict:
    return {**block, "after": load_average()}


def _minute(sample: Any) -> float | None:
    if isinstance(sample, list) and sample and isinstance(sample[0], (int, float)):
        return float(sample[0])
    return None


def busy(block: Any) -> str | None:
    """Why timings taken under this load are not judged ('load average 3.6 on 2 CPUs'), or None:
    the 1-minute load average above the CPU count, before or after. A record without the block
    (an older one) is not judged busy."""
    if not isinstance(block, dict):
        return None
    cpus = block.get("cpus")
    peaks = [m for m in map(_minute, (block.get("before"), block.get("after"))) if m is not None]
    if not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1 or not peaks:
        return None
    worst = max(peaks)
    return f"load average {worst:.1f} on {cpus} CPUs" if worst > cpus else None


def describe(block: Any) -> str | None:
    """'load average 0.4 → 1.9 on 2 CPUs' (1 minute, before -> after), or None without the block."""
    if not isinstance(block, dict) or not isinstance(block.get("cpus"), int):
        return None
    values = [_minute(block.get(when)) for when in ("before", "after")]
    shown = " → ".join(f"{v:.1f}" for v in values if v is not None)
    return f"load average {shown} on {block['cpus']} CPUs" if shown else None
