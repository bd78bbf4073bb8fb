"""The build section: how the extension was built, and each kernel's resources (registers, static
and dynamic shared memory, stack, spills), against the base branch's build when one is given."""

from __future__ import annotations

from .. import markdown as md
from .inputs import BUILD_LOG_TAIL_LINES, Inputs
from .sections import FAIL, OK, WARN, Detail, Section, absent, stale_section, unreadable_section


def _kernel_key(kernel: dict) -> tuple[str, str]:
    return (str(kernel.get("kernel", "?")), str(kernel.get("arch", "?")))


def _spills(kernel: dict) -> tuple[int, int]:
    return (md.integer(kernel.get("spill_stores")) or 0, md.integer(kernel.get("spill_loads")) or 0)


def kernel_changes(kernel: dict, base: dict | None) -> tuple[list[str], bool]:
    """What changed against the base build, and whether a spill is new (none in the base)."""
    stores, loads = _spills(kernel)
    if base is None:
        return (["new kernel"] + (["🆕 spills"] if stores or loads else []), bool(stores or loads))
    changes = []
    base_stores, base_loads = _spills(base)
    new_spill = bool(stores or loads) and not (base_stores or base_loads)
    if new_spill:
        changes.append(f"🆕 spills ({stores} B st, {loads} B ld)")
    elif (stores, loads) != (base_stores, base_loads):
        if stores or loads:
            changes.append(f"spills {base_stores}/{base_loads} → {stores}/{loads} B")
        else:
            changes.append("spills gone")
    for field, label in (
        ("registers", "regs"),
        ("smem_bytes", "static smem B"),
        ("dynamic_smem", "dynamic smem B"),
        ("stack_bytes", "stack B"),
    ):
        now, was = md.integer(kernel.get(field)), md.integer(base.get(field))
        if now is not None and was is not None and now != was:
            changes.append(f"{now - was:+d} {label}")
    return changes, new_spill


def build_seconds(inputs: Inputs, build: dict) -> float | None:
    """The build's one time: the stage's wall time, as the stage table shows it (loading torch and
    checking the build included), else build.json's own (a record without its stage)."""
    stage = inputs.stages.get("build") if "build" not in inputs.stale_stages else None
    seconds = (stage or {}).get("seconds")
    return seconds if seconds is not None else md.num(build.get("elapsed_s"))


def build_section(inputs: Inputs, detail: Detail) -> Section:
    title = "Build"
    if "build.json" in inputs.unreadable:
        return unreadable_section("build", title, "build.json", inputs.unreadable["build.json"])
    if "build.json" in inputs.stale:
        return stale_section("build", title, "build.json", inputs.stale["build.json"])
    build, log = inputs.build, inputs.build_log
    status = str((build or {}).get("status", "ok")).lower()
    if build is None and log is None:
        body = (
            "The build stage failed and left neither `build.json` nor `build.log`; see the job "
            "log. Reproduce: `nox -s build`."
        )
        return absent(inputs, "build", title, "build.json", "build failed", body)
    failed = build is None or status in ("failed", "fail", "error")
    parts = []
    if build:
        facts = [f"**backend** {md.text(build.get('backend', '?'))}"]
        archs = build.get("arch_list") or []
        if archs:
            facts.append("**arch** " + ", ".join(md.sm(a) or "?" for a in archs))
        if build.get("torch_version"):
            facts.append(f"**torch** {md.text(build['torch_version'])}")
        if build.get("cuda_version"):
            facts.append(f"**CUDA** {md.text(build['cuda_version'])}")
        if build.get("nvcc_version"):
            facts.append(f"**nvcc** {md.text(build['nvcc_version'])}")
        elapsed = build_seconds(inputs, build)
        if elapsed is not None:
            kind = (
                "compiled"
                if build.get("cold")
                else "up to date: nothing compiled"
                if build.get("cold") is False
                else ""
            )
            facts.append(f"**time** {md.duration(elapsed)}" + (f" ({kind})" if kind else ""))
        if build.get("compiler_warnings"):
            facts.append(f"**compiler warnings** {md.text(build['compiler_warnings'])}")
        parts.append(" · ".join(facts))
        if build.get("reason"):
            parts.append(f"Why this backend: {md.text(build['reason'])}")
    if failed:
        summary = "failed"
        if build and build_seconds(inputs, build) is not None:
            summary += f" after {md.duration(build_seconds(inputs, build))}"
        error = (build or {}).get("error")
        if error:
            parts.append("**Error**\n\n" + md.fenced(md.tail(str(error), 40)))
        if log:
            parts.append(f"**`build.log`, last {BUILD_LOG_TAIL_LINES} lines**\n\n" + md.fenced(log))
        if not error and not log:
            parts.append(
                "The build failed and left neither an error message nor `build.log`; see the job log."
            )
        parts.append("Reproduce: `nox -s build` (add `-- --force` to rebuild from scratch).")
        return Section("build", title, FAIL, summary, "\n\n".join(parts), [(FAIL, "build failed")])

    kernels = [k for k in build.get("kernels") or [] if isinstance(k, dict)]
    base = inputs.base_build
    base_kernels = {}
    if base is not None:
        base_kernels = {_kernel_key(k): k for k in base.get("kernels") or [] if isinstance(k, dict)}
    rows, new_spills, spilling, changed = [], 0, 0, 0
    for kernel in kernels:
        stores, loads = _spills(kernel)
        spilling += bool(stores or loads)
        changes: list[str] = []
        if base is not None:
            changes, new_spill = kernel_changes(kernel, base_kernels.get(_kernel_key(kernel)))
            new_spills += new_spill
            changed += bool(changes)
        flagged = bool(stores or loads or changes)
        if not detail.passing and not flagged:
            continue
        rows.append(
            [
                md.code(kernel.get("kernel", "?"), 120),
                md.text(kernel.get("arch", "?")),
                md.sig(kernel.get("registers")),
                md.nbytes(kernel.get("smem_bytes")),
                md.nbytes(kernel.get("dynamic_smem")),  # absent from older build.json: "—"
                md.sig(kernel.get("stack_bytes")),
                ("⚠️ " if stores or loads else "") + f"{stores} / {loads}",
            ]
            + (["; ".join(changes) or "—"] if base is not None else [])
        )
    removed = [key for key in base_kernels if key not in {_kernel_key(k) for k in kernels}]
    header = ["kernel", "arch", "registers", "static smem", "dynamic smem", "stack B"]
    header.append("spill st / ld B")
    if base is not None:
        header.append("vs base")
    if rows:
        parts.append(md.table(header, rows))
    hidden = len(kernels) - len(rows)
    if hidden:
        parts.append(f"_{md.plural(hidden, 'kernel')} without spills or changes not shown._")
        detail.omitted.append("passing details")
    if not kernels:
        parts.append("No per-kernel resource usage (CPU build, or ptxas printed none).")
    if removed:
        parts.append(
            "Kernels in the base build but not here: "
            + ", ".join(md.code(k[0], 120) + f" ({md.text(k[1])})" for k in removed)
        )
    if (
        inputs.base_build_path
        and base is None
        and f"base build ({inputs.base_build_path})" not in inputs.unreadable
    ):
        parts.append(
            f"No base build to compare with (`{md.text(inputs.base_build_path)}` not found)."
        )

    problems = []
    severity = OK
    if base is not None and new_spills:
        severity = WARN
        problems.append((WARN, f"new register spills in {md.plural(new_spills, 'kernel')}"))
    elif base is None and spilling:
        severity = WARN
        problems.append((WARN, f"register spills in {md.plural(spilling, 'kernel')}"))
    summary = f"{md.text(build.get('backend', '?'))}"
    if build.get("arch_list"):
        summary += " " + ", ".join(md.sm(a) or "?" for a in build["arch_list"])
    summary += f", {md.plural(len(kernels), 'kernel')}"
    summary += f", {md.plural(spilling, 'spilling kernel')}" if spilling else ", no spills"
    if base is not None:
        if new_spills:
            summary += f", {md.plural(new_spills, 'new spill')}"
        summary += f", {changed} changed vs base" if changed else ", same as base"
    if "build.log" in inputs.unreadable:
        parts.append(f"`build.log` unreadable: {md.text(inputs.unreadable['build.log'])}")
    return Section("build", title, severity, summary, "\n\n".join(parts), problems)
