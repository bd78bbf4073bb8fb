"""`python -m flashmoe_science COMMAND` (and the `flashmoe-science` command). In an installed package,
`build` prebuilds the per-user cache (the loader's command, no reports); in a checkout every command
is the pipeline's."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from . import _loader


def main(argv: Sequence[str] | None = None) -> int:
    # Each line out as it is written, also where stdout is a pipe (nox, a CI log), where Python
    # would hold up to 8 KB back: progress and verdict lines keep their order with stderr's, and
    # a step stopped by a time limit still shows what it printed.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["build"] and _loader.installed():
            return _loader.main(argv[1:])
        from .pipeline.cli import main as pipeline_main

        return pipeline_main(argv)
    except BrokenPipeError:
        # The reader left (`... --list | head`): what it did not read is not an error of ours.
        # stdout goes to /dev/null so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as the shell reports a reader that closed early


if __name__ == "__main__":
    sys.exit(main())
