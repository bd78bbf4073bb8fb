"""`python -m flashmoe_science test` (and so `nox -s test`): build incrementally, then run the gates.

Exit codes follow the `git bisect run` contract (flashmoe_science.pipeline.exitcodes), so
`git bisect run nox -s test` finds the commit that broke correctness:
  0   every gate passed                         -> good
  1   a gate failed                             -> bad
  125 this commit cannot be built               -> skipped
  255 the environment is broken (no GPU where one is required, torch missing, pytest unusable)
                                                -> the bisect stops instead of blaming a commit
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from . import exitcodes
from .paths import REPO_ROOT, require_gpu_from_env

PYTEST_EXIT_GATE_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe_science test",
        description="Build (incrementally) and run the correctness gates. Unknown options go to pytest, "
        "e.g. `-k 'fwd-fp16-d64' -x`.",
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        default=require_gpu_from_env(),
        help="a missing GPU or CUDA build is an error, exit 255 (default: FLASHMOE_REQUIRE_GPU=1)",
    )
    parser.add_argument(
        "--workers", default=None, help="pytest-xdist workers (default: auto, at most 8)"
    )
    return parser


def _workers(requested: str | None) -> str:
    if requested:
        return requested
    return str(max(1, min(8, os.cpu_count() or 1)))


def main(argv: list[str]) -> int:
    args, pytest_args = _parser().parse_known_args(argv)
    start = time.monotonic()
    try:
        import torch
    except ImportError as exc:
        print(
            f"test: torch is not importable ({exc}); fix: run scripts/setup_environment.sh",
            file=sys.stderr,
        )
        return exitcodes.ENV_BROKEN
    if args.require_gpu and not torch.cuda.is_available():
        print(
            "test: --require-gpu but torch sees no GPU; fix: check `nvidia-smi` and that torch is a CUDA build",
            file=sys.stderr,
        )
        return exitcodes.ENV_BROKEN

    from . import build

    try:
        config = build.resolve_config(backend="cuda" if args.require_gpu else "auto")
        build.build(config)
    except build.ConfigError as exc:
        print(f"test: cannot configure the build: {exc}", file=sys.stderr)
        return exc.exit_code
    except build.BuildError as exc:
        print(
            f"test: this commit does not build (exit {exitcodes.BUILD_FAILED}, git bisect skips it)\n{exc}",
            file=sys.stderr,
        )
        return exitcodes.BUILD_FAILED

    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-n",
        _workers(args.workers),
        "-q",
        *pytest_args,
    ]
    print(f"test: {' '.join(cmd[2:])}", flush=True)
    env = dict(os.environ, FLASHMOE_REQUIRE_GPU="1" if args.require_gpu else "")
    rc = subprocess.call(cmd, cwd=REPO_ROOT, env=env)
    elapsed = time.monotonic() - start
    if rc == 0:
        print(f"test: all gates passed in {elapsed:.1f} s")
        return exitcodes.OK
    if rc == PYTEST_EXIT_GATE_FAILED:
        print(
            f"test: gates FAILED in {elapsed:.1f} s; each failure above ends with a command that reruns it"
        )
        return exitcodes.GATE_FAILED
    # 2 interrupted, 3 internal error, 4 usage error, 5 no tests collected: none says the commit is bad.
    print(
        f"test: pytest exited {rc} (interrupted, internal or usage error, or no tests); not a verdict on "
        "this commit",
        file=sys.stderr,
    )
    return exitcodes.ENV_BROKEN
