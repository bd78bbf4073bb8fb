"""What each compute-sanitizer tool checks of the Hopper features the sm_90a kernels use: TMA bulk
tensor copies, wgmma, mbarriers and named barriers, and bulk reductions.

Two things decide it. The installed tool's options: `compute-sanitizer --help` is read once
(offered_options, a pure function over its text), and the Hopper options it offers are passed as
`yes` to the tools they concern (tool_options), so that a check never rests on a default. And
fixed facts about each tool, from the Compute Sanitizer documentation (its options table and the
chapter of each tool):

- `--check-bulk-copy` (default yes) "enables checks related to the PTX cp.async.bulk instructions
  on Hopper"; it is a general option, and which tools use it is not said.
- `--check-warpgroup-mma` (default yes) "enables memcheck and synccheck support" for wgmma;
  synccheck then checks that every warp of a warpgroup runs the same wgmma sequence.
- memcheck checks out-of-bounds and misaligned accesses; synchronization is outside its scope.
- initcheck checks reads of uninitialized global memory (`--initcheck-address-space global`,
  the default, which is what runs here): wgmma's operands are in shared memory.
- synccheck checks __syncthreads, __syncwarp and cuda::barrier (Ampere and newer), and wgmma
  sequences; the kernels use PTX mbarriers directly, and a wait on the wrong phase is not among
  its documented errors.
- racecheck checks shared memory only, between threads' accesses; its asynchronous-copy checks
  are documented for cp.async and cuda::memcpy_async, not for TMA, whose writes come from the
  copy engine rather than a thread, nor for wgmma, which reads shared memory through the async
  proxy. Named barriers between a producer warp and its consumers it gets wrong, measured: it
  reports a correct handoff as hazards (RACECHECK_ENV says what it runs instead).

coverage() turns both into one statement per feature and tool: checked, not checked, or not
documented, with why. sanitize.json carries it per tool; the console summary and the report show
what is not checked instead of a bare PASS.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

BULK_COPY = "--check-bulk-copy"
WARPGROUP_MMA = "--check-warpgroup-mma"
OPTIONS = (BULK_COPY, WARPGROUP_MMA)

CHECKED, NOT_CHECKED, UNDOCUMENTED = "checked", "not checked", "not documented"
STATUSES = (CHECKED, NOT_CHECKED, UNDOCUMENTED)

# Short names (the console and the report's table) of the features, in the order shown.
FEATURES = {
    "tma": "TMA",  # cp.async.bulk.tensor loads into shared memory, completed on an mbarrier
    "bulk_reduce": "bulk reduce",  # cp.reduce.async.bulk from shared into global memory
    "wgmma": "wgmma",  # reads its shared-memory operands through the async proxy
    "mbarrier": "mbarrier",  # init, arrive, expect_tx, try_wait.parity
    "named_barrier": "named barrier",  # barrier.sync / barrier.arrive handing a buffer between warps
}


@dataclasses.dataclass(frozen=True)
class Fact:
    """What one tool does about one feature. `option`: the option the check rests on; passed as
    `yes` where the installed tool offers it, and without it the feature is not checked."""

    status: str
    why: str
    option: str | None = None


# The environment racecheck's runs add. The warp-specialized backward's stats warp hands lse and
# delta to the math warpgroups and takes them back by named barriers; racecheck reports that
# handoff as WAR hazards, and does the same for a 60-line program that hands two buffers over the
# same way, correct by the PTX memory model, whether the consumers arrive or wait, by bar or
# barrier, or by an mbarrier (benches/notes/backward.md, "racecheck and named barriers"). Its
# other shared-memory traffic is TMA's and wgmma's, which racecheck does not see either. So
# racecheck checks the tile before it (Sm90BwdTraits, the same schedule with every copy a thread's)
# and the other three tools the warp-specialized one.
RACECHECK_ENV = {"FLASHMOE_BWD_WS": "0"}
_RACECHECK_SWITCH = ", ".join(f"{name}={value}" for name, value in RACECHECK_ENV.items())

_RACECHECK_SCOPE = "racecheck checks threads' shared-memory accesses"
FACTS: dict[str, dict[str, Fact]] = {
    "memcheck": {
        "tma": Fact(
            CHECKED,
            "--check-bulk-copy yes: checks related to cp.async.bulk (the documentation does not "
            "list them)",
            BULK_COPY,
        ),
        "bulk_reduce": Fact(
            UNDOCUMENTED,
            "--check-bulk-copy names cp.async.bulk; cp.reduce.async.bulk is not mentioned",
            BULK_COPY,
        ),
        "wgmma": Fact(CHECKED, "wgmma support (--check-warpgroup-mma yes)", WARPGROUP_MMA),
        "mbarrier": Fact(
            NOT_CHECKED, "phases and arrival counts are no memory access error: outside memcheck"
        ),
        "named_barrier": Fact(NOT_CHECKED, "synchronization is outside memcheck"),
    },
    "initcheck": {
        "tma": Fact(
            UNDOCUMENTED,
            "whether a TMA load counts as a read of global memory is not documented",
            BULK_COPY,
        ),
        "bulk_reduce": Fact(
            UNDOCUMENTED,
            "whether a bulk reduction's read-modify-write of global memory counts is not "
            "documented",
            BULK_COPY,
        ),
        "wgmma": Fact(
            NOT_CHECKED,
            "its operands are in shared memory, and initcheck checks global memory here "
            "(--initcheck-address-space global)",
        ),
        "mbarrier": Fact(NOT_CHECKED, "synchronization is outside initcheck"),
        "named_barrier": Fact(NOT_CHECKED, "synchronization is outside initcheck"),
    },
    "synccheck": {
        "tma": Fact(
            UNDOCUMENTED,
            "synccheck documents barrier and wgmma checks; bulk-copy checks are not said to "
            "apply to it",
            BULK_COPY,
        ),
        "bulk_reduce": Fact(
            UNDOCUMENTED,
            "synccheck documents barrier and wgmma checks; bulk-copy checks are not said to "
            "apply to it",
            BULK_COPY,
        ),
        "wgmma": Fact(
            CHECKED,
            "every warp of a warpgroup runs the same wgmma sequence (--check-warpgroup-mma yes)",
            WARPGROUP_MMA,
        ),
        "mbarrier": Fact(
            UNDOCUMENTED,
            "documented for cuda::barrier; PTX mbarriers and waits on the wrong phase are not",
        ),
        "named_barrier": Fact(
            UNDOCUMENTED,
            "documented for __syncthreads and __syncwarp; a producer's barrier.sync against its "
            "consumers' barrier.arrive is not",
        ),
    },
    "racecheck": {
        "tma": Fact(
            NOT_CHECKED,
            f"{_RACECHECK_SCOPE}; its async-copy checks cover cp.async and memcpy_async, and a "
            "TMA write comes from the copy engine, not a thread",
        ),
        "bulk_reduce": Fact(
            UNDOCUMENTED,
            f"{_RACECHECK_SCOPE}; its async-copy checks are documented for cp.async and "
            "memcpy_async only",
            BULK_COPY,
        ),
        "wgmma": Fact(
            NOT_CHECKED,
            f"{_RACECHECK_SCOPE}; wgmma reads its operands through the async proxy, and "
            "--check-warpgroup-mma is for memcheck and synccheck",
        ),
        "mbarrier": Fact(
            UNDOCUMENTED,
            "cuda::barrier waits are documented as synchronization; PTX mbarriers completed by "
            "TMA transaction bytes are not",
        ),
        "named_barrier": Fact(
            NOT_CHECKED,
            "a correct handoff between a producer warp and its consumers by named barriers (or by "
            "an mbarrier) is reported as hazards, so racecheck runs the wgmma backward's tile "
            f"before the warp-specialized one ({_RACECHECK_SWITCH} on its runs)",
        ),
    },
}


def offered_options(help_text: str) -> frozenset[str]:
    """The options of OPTIONS that `compute-sanitizer --help` lists: each starts a line, indented
    a little (`  --check-bulk-copy arg (=yes)  Enables ...`); a description's wrapped lines are
    indented far more, and a word there is no option."""
    return frozenset(
        option
        for option in OPTIONS
        if re.search(rf"(?m)^[ \t]{{0,4}}{re.escape(option)}(?![\w-])", help_text)
    )


def tool_options(tool: str, offered: Iterable[str]) -> list[str]:
    """The Hopper options to pass to `tool`, each as `yes`: those its checks rest on that the
    installed compute-sanitizer offers."""
    offered = set(offered)
    wanted = {fact.option for fact in FACTS[tool].values() if fact.option in offered}
    return [word for option in OPTIONS if option in wanted for word in (option, "yes")]


def coverage(tool: str, offered: Iterable[str] | None) -> list[dict[str, str]]:
    """One statement per feature: {"feature", "status", "why"}, in FEATURES order. `offered`
    None: the tool's --help could not be read, so no Hopper option was passed."""
    statements = []
    for feature, fact in FACTS[tool].items():
        status, why = fact.status, fact.why
        if fact.option and offered is None:
            status, why = NOT_CHECKED, f"{fact.option} not passed: the tool's --help was unreadable"
        elif fact.option and fact.option not in offered:
            status, why = NOT_CHECKED, f"this compute-sanitizer has no {fact.option}"
        statements.append({"feature": feature, "status": status, "why": why})
    return statements


def gaps(statements: list[dict], status: str = NOT_CHECKED) -> list[str]:
    """The short names of the features with `status` (default: not checked)."""
    return [FEATURES.get(s["feature"], s["feature"]) for s in statements if s["status"] == status]


def gap_line(statements: list[dict]) -> str | None:
    """`not checked: TMA, wgmma; not documented: mbarrier`, or None when all are checked."""
    parts = [
        f"{status}: {', '.join(names)}"
        for status in (NOT_CHECKED, UNDOCUMENTED)
        if (names := gaps(statements, status))
    ]
    return "; ".join(parts) or None
