"""Markdown for GitHub: numbers, durations and sizes as table cells, and free text made safe.

Everything a pipeline record holds is data, possibly from a pull request's code: `text` and `code`
escape it so that no value can open a tag, break a table row or end a code span early.
"""

from __future__ import annotations

import math
import re
from typing import Any

TIMES = "\u00d7"  # the multiplication sign, as in "1.25 times faster"
DASH = "—"  # a missing value


def num(value: Any) -> float | None:
    """A finite number, or None (for missing values, booleans, NaN and Inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def integer(value: Any) -> int | None:
    number = num(value)
    return int(number) if number is not None else None


def sig(value: Any, digits: int = 3) -> str:
    """A number in `digits` significant figures; '—' for missing, NaN or Inf."""
    number = num(value)
    if number is None:
        return DASH
    if number != 0 and abs(number) >= 10**digits:
        return f"{number:,.0f}"
    return f"{number:.{digits}g}"


def times(value: Any, digits: int = 3) -> str:
    """A ratio such as '1.44' followed by TIMES; '—' when missing."""
    text_ = sig(value, digits)
    return text_ if text_ == DASH else text_ + TIMES


def duration(seconds: Any) -> str:
    """'4.2 s', '3m 09s', '1h 02m'; '—' when missing."""
    number = num(seconds)
    if number is None:
        return DASH
    if number < 60:
        return f"{number:.1f} s"
    total = round(number)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def nbytes(value: Any) -> str:
    """'48 KiB', '129 MiB', '512 B'; '—' when missing."""
    number = num(value)
    if number is None:
        return DASH
    for unit, size_ in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(number) >= size_:
            return f"{number / size_:.3g} {unit}"
    return f"{int(number)} B"


def text(value: Any, limit: int = 300) -> str:
    """Free text from an input file, made safe for one markdown table cell or list item."""
    flat = " ".join(str(value).split())
    if len(flat) > limit:
        flat = flat[: limit - 1] + "…"
    return flat.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def code(value: Any, limit: int = 300) -> str:
    """Inline code that survives any backticks in the value."""
    flat = " ".join(str(value).split())[:limit].replace("|", "\\|")
    fence = "`" * (max((len(m) for m in re.findall(r"`+", flat)), default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def fenced(body: str, lang: str = "") -> str:
    """A code block whose fence is longer than any run of backticks inside it."""
    fence = "`" * max(3, max((len(m) for m in re.findall(r"`+", body)), default=0) + 1)
    return f"{fence}{lang}\n{body}\n{fence}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plural(count: int, word: str, many: str | None = None) -> str:
    """'1 kernel', '3 kernels', '2 new spills'."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def sm(capability: Any) -> str | None:
    """'8.9' / [8, 9] / 89 -> 'sm_89'."""
    if capability in (None, ""):
        return None
    if isinstance(capability, (list, tuple)):
        return "sm_" + "".join(str(part) for part in capability[:2])
    value = str(capability)
    if value.startswith("sm_"):
        return value
    return "sm_" + value.replace(".", "")


def size(body: str) -> int:
    """The size GitHub's comment limit is checked against (UTF-8 bytes: never fewer than chars)."""
    return len(body.encode("utf-8"))


def tail(body: str, lines: int, width: int = 300) -> str:
    """The last `lines` lines, each cut to `width` characters."""
    kept = body.rstrip("\n").splitlines()[-lines:]
    return "\n".join(line if len(line) <= width else line[: width - 1] + "…" for line in kept)
