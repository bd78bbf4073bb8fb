"""Markdown for GitHub: numbers, durations and sizes as table cells, and free text made safe.

Everything a pipeline record holds is data, possibly from a pull request's code: `text` and `code`
escape it so that no value can open a tag, close the report's `<details>`, start a heading, a link
or an image, mention a user (`@name`) or link an issue (`#12`), break a table row or end a code span
early. Numbers pass through `num`, which turns what is not a finite float (a 400-digit integer
included) into a missing value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

TIMES = "\u00d7"  # the multiplication sign, as in "1.25 times faster"
DASH = "—"  # a missing value


ZWSP = "\u200b"  # a zero-width space: GitHub links no `@name`, `#12` or URL that it splits
# Characters that start a code span, a link or an image (`[`, and so `![`), escaped with a backslash;
# the backslash too, so that one in the value cannot undo ours. Emphasis is left alone: harmless.
_MARKDOWN = re.compile(r"([\\`\[\]])")
_AUTOLINK = re.compile(r"(?i)(://|www\.)")
_STR_CAP = 20_000  # characters of one value looked at before flattening; the rest is cut anyway


def num(value: Any) -> float | None:
    """A finite number, or None (for missing values, booleans, NaN, Inf and integers too large
    for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


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


def flat(value: Any, limit: int = 300) -> str:
    """A value as one line of at most `limit` characters (whitespace runs become one space). A
    value nested too deeply to print becomes a placeholder rather than an error."""
    try:
        raw = value if isinstance(value, str) else str(value)
    except (RecursionError, ValueError):  # deep nesting; an int of more digits than str() allows
        raw = f"({type(value).__name__} not shown)"
    line = " ".join(raw[:_STR_CAP].split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def text(value: Any, limit: int = 300) -> str:
    """Free text from an input file, made safe for one markdown table cell or list item: HTML and
    markdown escaped, mentions, issue references and URLs broken so that GitHub links nothing."""
    line = flat(value, limit)
    line = line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    line = _MARKDOWN.sub(r"\\\1", line).replace("|", "\\|")
    line = line.replace("@", "@" + ZWSP).replace("#", "#" + ZWSP)
    return _AUTOLINK.sub(lambda m: m.group(1)[0] + ZWSP + m.group(1)[1:], line)


def code(value: Any, limit: int = 300) -> str:
    """Inline code that survives any backticks in the value (GitHub renders nothing inside it:
    no HTML, link or mention)."""
    line = flat(value, limit).replace("|", "\\|")
    fence = "`" * (max((len(m) for m in re.findall(r"`+", line)), default=0) + 1)
    pad = " " if line.startswith("`") or line.endswith("`") else ""
    return f"{fence}{pad}{line}{pad}{fence}"


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
    """'8.9' / [8, 9] / 89 / 'sm_90a' -> 'sm_89' ... ; None for anything else (a capability is
    digits, nothing a pull request could use to write markup)."""
    if capability is None or isinstance(capability, bool) or capability == "":
        return None
    if isinstance(capability, (list, tuple)):
        parts = [p for p in capability[:2] if isinstance(p, int) and not isinstance(p, bool)]
        value = "".join(str(p) for p in parts) if len(parts) == len(capability[:2]) else ""
    elif isinstance(capability, (int, float, str)):
        value = flat(capability, 12).removeprefix("sm_").replace(".", "")
    else:
        value = ""
    return "sm_" + value if re.fullmatch(r"[0-9]{2,3}[a-z]?", value) else None


def first(items: list, count: int = 5, sep: str = ", ", show: Callable[[Any], str] = str) -> str:
    """The first `count` items, each through `show`, joined, then 'and N more': a list from a
    record stays short, and only what is shown is formatted."""
    shown = sep.join(show(item) for item in items[:count])
    return shown + (f"{sep}and {len(items) - count:,} more" if len(items) > count else "")


def size(body: str) -> int:
    """The size GitHub's comment limit is checked against (UTF-8 bytes: never fewer than chars)."""
    return len(body.encode("utf-8"))


def tail(body: str, lines: int, width: int = 300) -> str:
    """The last `lines` lines, each cut to `width` characters."""
    kept = body.rstrip("\n").splitlines()[-lines:]
    return "\n".join(line if len(line) <= width else line[: width - 1] + "…" for line in kept)
