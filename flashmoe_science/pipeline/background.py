"""A pipeline command run in the background of a CI job, to be waited for by a later step.

GitHub Actions runs a job's steps one after another; a stage that needs the build but neither a
quiet GPU nor the test stage's results (`sanitize`) can run beside the test stage this way: one
step starts it (`--background`) and returns at once, a later step (`--wait`) waits for it, prints
its output and exits with its status. The start writes reports/<name>-background.json ({"pid",
"argv", "started"}), the run its exit to <name>-background-exit.json ({"exit", "ended"}: a file
of its own, so a run that ends at once cannot race the start's write) and its output to
<name>-background.log; all travel with the job's reports. The child is a session of its own, so
the starting step's end does not stop it; the runner stops it at the job's end if nothing waited.
It runs at a lower CPU priority (NICENESS more than the job's): the step it runs beside is the
one the pull request waits on (the test stage's compiles slowed 2-2.4x beside seven sanitizer
processes at equal priority on an H100's 16 cores: benches/notes/harness.md v5.13).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .. import _loader
from . import exitcodes, paths

POLL_S = 2.0
NICENESS = 10  # added to the job's; the kernel caps it at 19
PROGRESS_S = 30.0  # how often a wait says it is still waiting


def state_path(name: str) -> Path:
    return paths.report_dir() / f"{name}-background.json"


def exit_path(name: str) -> Path:
    return paths.report_dir() / f"{name}-background-exit.json"


def log_path(name: str) -> Path:
    return paths.report_dir() / f"{name}-background.log"


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    tmp.replace(path)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def start(name: str, argv: Sequence[str], wait_hint: str) -> int:
    """Start `python -m flashmoe_science <argv>` detached, through `child` (which records its exit
    status); returns at once. `wait_hint`: the command that waits for it."""
    log = log_path(name)
    exit_path(name).unlink(missing_ok=True)
    command = [sys.executable, "-m", "flashmoe_science.pipeline.background", "child", name, *argv]
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _write(state_path(name), {"pid": process.pid, "argv": list(argv), "started": time.time()})
    print(
        f"{name}: started in the background (pid {process.pid}), output to "
        f"{_loader.display_path(log)}; `{wait_hint}` waits for it",
        flush=True,
    )
    return exitcodes.OK


def child(name: str, argv: Sequence[str]) -> int:
    """Runs the command in this process's session and records its exit status for `wait`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    niceness = os.nice(NICENESS)  # the command's processes inherit it
    print(f"{name}: running in the background at niceness {niceness}", flush=True)
    code = subprocess.call([sys.executable, "-m", "flashmoe_science", *argv], env=env)
    _write(exit_path(name), {"exit": code, "ended": time.time()})
    return code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait(name: str) -> int:
    """Waits for the background run of `name`, prints its output and returns its exit status (the
    CI step's own time limit bounds the wait)."""
    state = _read(state_path(name))
    if state is None:
        print(
            f"{name}: nothing was started in the background ({_loader.display_path(state_path(name))} "
            f"missing): start it with --background first, or run it without --wait",
            file=sys.stderr,
            flush=True,
        )
        return exitcodes.USAGE
    begin = time.monotonic()
    said = begin
    ended = _read(exit_path(name))
    while ended is None:
        if not _alive(int(state["pid"])):
            ended = _read(exit_path(name))
            if ended is not None:
                break
            print(
                f"{name}: the background run (pid {state['pid']}) ended without an exit status "
                f"(killed?); its output, {_loader.display_path(log_path(name))}, follows",
                file=sys.stderr,
                flush=True,
            )
            _print_log(name)
            return exitcodes.ENV_BROKEN
        now = time.monotonic()
        if now - said >= PROGRESS_S:
            ran = time.time() - float(state.get("started", time.time()))
            print(f"{name}: still running in the background ({ran:.0f} s so far)", flush=True)
            said = now
        time.sleep(POLL_S)
        ended = _read(exit_path(name))
    waited = time.monotonic() - begin
    # (a run over before its start was recorded has no span to tell)
    ran = max(0.0, float(ended.get("ended", 0)) - float(state.get("started", 0)))
    print(
        f"{name}: the background run ended with exit {ended['exit']} after {ran:.1f} s "
        f"({waited:.1f} s of it waited for here); its output:",
        flush=True,
    )
    _print_log(name)
    return int(ended["exit"])


def _print_log(name: str) -> None:
    try:
        sys.stdout.write(log_path(name).read_text(errors="replace"))
    except OSError:
        print(f"({_loader.display_path(log_path(name))} unreadable)")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "child":
        return child(args[1], args[2:])
    print(
        "usage: python -m flashmoe_science.pipeline.background child NAME ARGS... (started by a "
        "command's --background)",
        file=sys.stderr,
    )
    return exitcodes.USAGE


if __name__ == "__main__":
    sys.exit(main())
