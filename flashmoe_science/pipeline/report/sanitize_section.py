"""The sanitizer section, from sanitize.json: each compute-sanitizer tool's result and what it
checks of the Hopper features (TMA, bulk reductions, wgmma, mbarriers), so that a PASS shows what
it did not look at. Without a readable sanitize.json of this run there is no section: the stage
table's sanitize row says what stages.json knows."""

from __future__ import annotations

from .. import markdown as md
from ..tools.sanitize_coverage import FEATURES, NOT_CHECKED, UNDOCUMENTED
from .inputs import Inputs, stage_failed
from .sections import FAIL, NOTRUN, OK, Detail, Section, stale_section

KEY, TITLE, RECORD = "sanitize", "Sanitizer", "sanitize.json"
MAX_TOOLS = 8  # the real record has four
MAX_ROWS = 64  # not-checked statements listed under the table; the real record has about ten


def shown(inputs: Inputs) -> bool:
    """Whether this section stands for the sanitize stage (then the stage table has no row of
    its own for it)."""
    return isinstance(inputs.sanitize, dict)


def _tools(doc: dict) -> list[tuple[str, dict]]:
    tools = doc.get("tools") if isinstance(doc.get("tools"), dict) else {}
    return [(name, t) for name, t in list(tools.items())[:MAX_TOOLS] if isinstance(t, dict)]


def _coverage(tool: dict) -> list[dict]:
    items = tool.get("coverage")
    return [s for s in items if isinstance(s, dict)] if isinstance(items, list) else []


def _feature(key: object) -> str:
    return FEATURES.get(key, md.text(key, 40)) if isinstance(key, str) else md.DASH


def _summary(doc: dict, tools: list[tuple[str, dict]]) -> str:
    failed = [md.text(name, 40) for name, t in tools if t.get("status") != "pass"]
    head = f"FAILED ({', '.join(failed)})" if failed else "clean"
    # feature -> the tools that do not check it, in the order of FEATURES
    unchecked: dict[str, list[str]] = {}
    for name, tool in tools:
        for item in _coverage(tool):
            if item.get("status") == NOT_CHECKED:
                unchecked.setdefault(_feature(item.get("feature")), []).append(md.text(name, 40))
    order = list(FEATURES.values())
    ranked = sorted(unchecked.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99)
    if ranked:
        head += "; not checked: " + ", ".join(
            f"{feature} ({', '.join(names)})" for feature, names in ranked
        )
    return head


def sanitize_section(inputs: Inputs, detail: Detail) -> Section | None:
    if RECORD in inputs.stale:
        return stale_section(KEY, TITLE, RECORD, inputs.stale[RECORD])
    if not shown(inputs):
        return None
    doc = inputs.sanitize
    tools = _tools(doc)
    if doc.get("status") is None:  # compute-sanitizer could not instrument this GPU
        return Section(
            KEY, TITLE, NOTRUN, "no verdict (the tool could not run)", f"no verdict in `{RECORD}`"
        )
    failed = stage_failed(inputs, KEY) or doc.get("status") != "pass"
    features = list(FEATURES)
    rows = []
    gaps = []
    for name, tool in tools:
        by_feature = {item.get("feature"): item for item in _coverage(tool)}
        cells = []
        for feature in features:
            status = (by_feature.get(feature) or {}).get("status")
            cells.append(
                f"**{status}**" if status == NOT_CHECKED else md.text(status or md.DASH, 40)
            )
        rows.append([md.text(name, 40), md.text(tool.get("status") or md.DASH, 40), *cells])
        gaps += [
            f"- {md.text(name, 40)}, {_feature(item.get('feature'))}: "
            f"{md.text(item.get('status'), 40)}: {md.text(item.get('why'), 300)}"
            for item in by_feature.values()
            if item.get("status") in (NOT_CHECKED, UNDOCUMENTED)
        ]
    version = md.text(doc.get("sanitizer_version") or "compute-sanitizer", 120)
    options = doc.get("sanitizer_options")
    offered = (
        "unknown (its --help could not be read)"
        if options is None
        else ", ".join(md.code(o, 60) for o in options[:8] if isinstance(o, str)) or "none"
    )
    body = [
        f"{version} on {md.text(doc.get('gpu') or 'an unknown GPU', 120)}. Hopper options it "
        f"offers, passed as `yes` to the tools they concern: {offered}.",
        "",
        md.table(["tool", "result", *(FEATURES[f] for f in features)], rows),
    ]
    if gaps:
        body += ["", "Not checked, or not documented as checked:", "", *gaps[:MAX_ROWS]]
        if len(gaps) > MAX_ROWS:
            body.append(f"- and {len(gaps) - MAX_ROWS:,} more")
    problems = [(FAIL, "sanitize failed")] if failed else []
    return Section(
        KEY, TITLE, FAIL if failed else OK, _summary(doc, tools), "\n".join(body), problems
    )
