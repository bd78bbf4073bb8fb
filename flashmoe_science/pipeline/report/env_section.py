"""The environment section: what env.json found, failures first."""

from __future__ import annotations

from typing import Any

from .. import markdown as md
from .inputs import Inputs
from .sections import FAIL, OK, WARN, Detail, Section, absent, stale_section, unreadable_section

MAX_ROWS = 50  # checks in the table; the real env stage has about 15


def env_facts(env: dict | None) -> list[str]:
    if not env:
        return []
    facts = []
    gpu = env.get("gpu") if isinstance(env.get("gpu"), dict) else None
    if gpu:
        name = md.text(gpu.get("name") or "GPU")
        sm = md.sm(gpu.get("capability"))
        extra = [sm] if sm else []
        if md.num(gpu.get("memory_gib")) is not None:
            extra.append(f"{md.sig(gpu['memory_gib'])} GiB")
        if (md.integer(gpu.get("count")) or 1) > 1:
            extra.append(f"{md.integer(gpu['count'])} visible")
        facts.append(f"**GPU** {name}" + (f" ({', '.join(extra)})" if extra else ""))
    else:
        facts.append("**GPU** none")
    if env.get("torch"):
        facts.append(f"**torch** {md.text(env['torch'])}")
    cuda = env.get("cuda")
    if isinstance(cuda, dict):
        if cuda.get("torch"):
            facts.append(f"**CUDA** {md.text(cuda['torch'])}")
        if cuda.get("nvcc"):
            facts.append(f"**nvcc** {md.text(cuda['nvcc'])}")
        if cuda.get("driver_version"):
            facts.append(f"**driver** {md.text(cuda['driver_version'])}")
    elif cuda:
        facts.append(f"**CUDA** {md.text(cuda)}")
    if env.get("python"):
        facts.append(f"**Python** {md.text(env['python'])}")
    if env.get("backend"):
        facts.append(f"**backend** {md.text(env['backend'])}")
    return facts


def env_section(inputs: Inputs, detail: Detail) -> Section:
    title = "Environment"
    if "env.json" in inputs.unreadable:
        return unreadable_section("env", title, "env.json", inputs.unreadable["env.json"])
    if "env.json" in inputs.stale:
        return stale_section("env", title, "env.json", inputs.stale["env.json"])
    env = inputs.env
    if env is None:
        return absent(
            inputs,
            "env",
            title,
            "env.json",
            "environment check failed",
            "The env stage failed and left no `env.json`; see the job log.",
        )
    checks = [c for c in env.get("checks") or [] if isinstance(c, dict)]
    if inputs.build is not None and "build.json" not in inputs.stale:
        # env runs before build, so its "extension not built yet" is no news when build ran too.
        checks = [
            c for c in checks if not (c.get("name") == "extension" and c.get("status") == "skip")
        ]
    by_status: dict[str, list[dict]] = {}
    for check in checks:
        by_status.setdefault(str(check.get("status", "?")), []).append(check)
    failed = by_status.get("fail", [])
    warned = by_status.get("warn", [])
    passed_flag = env.get("passed")
    severity = FAIL if failed or passed_flag is False else WARN if warned else OK
    counts = ", ".join(
        f"{len(v)} {k}" for k, v in sorted(by_status.items(), key=lambda kv: _status_rank(kv[0]))
    )
    if failed:
        summary = "failed: " + md.first(
            [c.get("name") for c in failed], 5, show=lambda name: md.text(name, 80)
        )
    elif passed_flag is False:
        summary = "failed"
    else:
        summary = f"{counts or 'no checks'}"
    problems = []
    if severity == FAIL:
        names = md.first([c.get("name") for c in failed], 3, show=lambda name: md.text(name, 60))
        problems.append((FAIL, "environment check failed" + (f" ({names})" if names else "")))
    elif warned:
        problems.append((WARN, md.plural(len(warned), "environment warning")))

    parts = [" · ".join(env_facts(env))]
    if env.get("require_gpu"):
        parts[0] += " · GPU required"
    shown = [c for c in checks if c.get("status") in ("fail", "warn")]
    hidden = [c for c in checks if c.get("status") not in ("fail", "warn")]
    if detail.passing:
        shown += hidden
        hidden = []
    if shown:
        shown.sort(key=lambda c: _status_rank(str(c.get("status"))))
        if len(shown) > MAX_ROWS:  # failures first, so the cut keeps them
            hidden += shown[MAX_ROWS:]
            shown = shown[:MAX_ROWS]
        rows = [
            [
                _check_icon(c.get("status")),
                md.text(c.get("name")),
                md.text(c.get("detail")),
                md.text(c.get("fix") or ""),
            ]
            for c in shown
        ]
        parts.append(md.table(["", "check", "detail", "fix"], rows))
    if hidden:
        parts.append(f"_{md.plural(len(hidden), 'more check')} not shown (all are in `env.json`)._")
        detail.omitted.append("passing details")
    return Section("env", title, severity, summary, "\n\n".join(parts), problems)


def _status_rank(status: str) -> int:
    return {"fail": 0, "warn": 1, "ok": 2, "skip": 3}.get(status, 4)


def _check_icon(status: Any) -> str:
    return {"ok": "✅", "warn": "⚠️", "fail": "❌", "skip": "⏭️"}.get(str(status), "❔")
