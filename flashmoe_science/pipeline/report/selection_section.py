"""The selection section, from selection.json (flashmoe_science.pipeline.ci.selection): whether a
GPU CI leg ran the full matrix or reused the verdict main recorded for the same key, why, and the
run of main it reused (linked). Left out where no selection ran (a local run).

When the trusted job re-renders a pull request's report (--changed-files: the pull request's
changed paths as the API lists them), the choice is made again with the default branch's code:
a leg that reused main's verdict although the pull request changes a gate input fails.
"""

from __future__ import annotations

import re

from .. import markdown as md
from ..ci import selection
from .inputs import Inputs
from .sections import FAIL, NOTE, OK, Detail, Section, stale_section, unreadable_section

MAX_PATHS = 20  # changed gate inputs listed; the rest are counted
_RUN_URL = re.compile(r"^https://[\w.-]+/[\w.-]+/[\w.-]+/actions/runs/[0-9]{1,20}$")


def run_link(url: object, text: str) -> str:
    """A link to a run of this repository's Actions, or the text alone for anything else."""
    return f"[{text}]({url})" if isinstance(url, str) and _RUN_URL.match(url) else text


def reused_text(reused: dict) -> str:
    """'main's run at `3fa2c1d4e5f6`' linked to that run."""
    sha = str(reused.get("sha") or "")
    return run_link(reused.get("run_url"), "main's run") + f" at {md.code(sha[:12] or '?')}"


def _paths(paths: object) -> str:
    listed = (
        [md.code(p, 120) for p in paths if isinstance(p, str)] if isinstance(paths, list) else []
    )
    return md.first(listed, MAX_PATHS)


def selection_section(inputs: Inputs, detail: Detail) -> Section | None:
    title = "Selection"
    if "selection.json" in inputs.unreadable:
        return unreadable_section(
            "select", title, "selection.json", inputs.unreadable["selection.json"]
        )
    if "selection.json" in inputs.stale:
        return stale_section("select", title, "selection.json", inputs.stale["selection.json"])
    doc = inputs.selection
    if doc is None:
        return None
    reason = md.text(doc.get("reason") or "", 400)
    facts = []
    if doc.get("key"):
        facts.append(f"**key** {md.code(doc['key'], 220)}")
    if doc.get("base"):
        facts.append(f"**base** {md.code(doc['base'], 120)}")
    changed = doc.get("changed")
    if isinstance(changed, list):
        facts.append(f"**changed** {md.plural(len(changed), 'path')}")
    if doc.get("mode") != selection.REUSE:
        body = [" · ".join(facts), f"The full matrix ran: {reason}."]
        if doc.get("gate_inputs"):
            body.append(f"Gate inputs changed: {_paths(doc['gate_inputs'])}.")
        return Section(
            "select", title, OK, f"full matrix: {md.flat(reason, 160)}", "\n\n".join(body), []
        )
    main = doc.get("main") if isinstance(doc.get("main"), dict) else {}
    said = reused_text(main)
    body = [
        " · ".join(facts),
        f"{reason[:1].upper()}{reason[1:]}: this leg did not rebuild or rerun the CUDA gates. The correctness "
        f"verdict is the one {said} recorded for this very key (the same kernel build of the same "
        "gate inputs on this kind of card). To run the full matrix anyway, dispatch GPU CI with "
        "`full` (`nox -s select -- --full`).",
    ]
    sha12 = md.text(str(main.get("sha") or "?")[:12])
    severity, problems = NOTE, [(NOTE, f"gates reused from main's run at {sha12}")]
    summary = f"main's verdict reused ({said})"
    if inputs.changed_paths is not None:  # the trusted job's own reading of the PR's changes
        again = selection.decide(inputs.changed_paths)
        if again.mode == selection.FULL:
            severity = FAIL
            problems = [(FAIL, "main's verdict reused although the PR changes gate inputs")]
            summary = "reused main's verdict although gate inputs changed"
            body.append(
                f"❌ The pull request changes gate inputs ({_paths(again.gate_inputs)}): the "
                "default branch's selection runs the full matrix for it, so this verdict does not "
                "count. Rerun GPU CI on this commit."
            )
    return Section("select", title, severity, summary, "\n\n".join(body), problems)
