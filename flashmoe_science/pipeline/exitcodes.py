"""Exit codes shared by every command-line entry point (and so by the nox sessions).

They follow the `git bisect run` contract, so `git bisect run nox -s test` does the right thing:
0 marks a commit good, 1 marks it bad, 125 skips a commit that cannot be built, and anything above
127 aborts the bisect because the machine, not the commit, is at fault.
"""

OK = 0
GATE_FAILED = 1  # a correctness gate (or a benchmark regression check) failed: the commit is bad
USAGE = 2  # wrong command-line arguments
BUILD_FAILED = 125  # this commit cannot be built: git bisect skips it
TOOL_MISSING = 126  # an optional tool (ncu, compute-sanitizer) is missing or not permitted
ENV_BROKEN = 255  # the environment is broken (no GPU where one is required, torch missing): abort

NAMES = {
    OK: "ok",
    GATE_FAILED: "gate failed",
    USAGE: "usage error",
    BUILD_FAILED: "build failed (bisect: skip)",
    TOOL_MISSING: "tool missing",
    ENV_BROKEN: "environment broken (bisect: abort)",
}
