"""The test stage's time limit: a run that hangs names the tests it is stuck in before it stops.

A CI step that runs out of time is killed with everything under it, so a hung test (a kernel that
never returns, a child process that never exits) leaves a log that ends in a line of dots and a
report that says only that the stage did not finish. With FLASHMOE_TEST_TIME_LIMIT set to a number
of seconds, the stage's run on pytest-xdist workers (testing.run_command) stops itself first:

  1. it sends SIGNAL to pytest's process group (pytest runs in a session of its own);
  2. each worker prints every thread's stack to stderr (faulthandler, which needs no cooperation
     from a thread stuck in C); the controller names each test still running and for how long,
     writes gates.json as interrupted with those names as its reason, and exits;
  3. after GRACE_S, whatever is left of the group is killed.

A test's own child process (a planted-bug build's gate script) is in that group too: started with
child_watch()'s environment and descriptor and calling watch_as_child() first, it prints its stacks
beside its worker's; otherwise the signal ends it silently.

The stage then exits 255 (no verdict), its last line naming the tests. The limit counts from the
stage's start: its own build (nothing to do after a build step, minutes where it compiles) and
collection come out of it, so a limit set inside a CI step's timeout fires first; one that runs
out before the tests start stops the stage there, saying so (before_tests). The GPU job sets the
limit below its step's timeout-minutes (tests/ci/test_workflows.py checks the margin). A selection
small enough to run in the stage's own process (testing.SERIAL_MAX_TESTS) runs without the limit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

LIMIT_VAR = "FLASHMOE_TEST_TIME_LIMIT"
STACK_FD_VAR = "FLASHMOE_STACK_FD"  # a child's: the descriptor its worker prints stacks to
SIGNAL = signal.SIGUSR1
GRACE_S = 10.0  # after SIGNAL: time for the stacks, the names and the record, then SIGKILL
NAMED_MAX = 5  # tests named in the record's reason; the stage's output lists them all


class LimitError(ValueError):
    """FLASHMOE_TEST_TIME_LIMIT holds something other than a positive number of seconds."""


def limit_from_env(env: dict[str, str] | None = None) -> float | None:
    """The limit in seconds; None where LIMIT_VAR is unset or empty. Raises LimitError (one line)
    for anything else that is not a positive number."""
    text = (os.environ if env is None else env).get(LIMIT_VAR, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise LimitError(
            f"{LIMIT_VAR}={text!r}: supported: a positive number of seconds (e.g. 450), or unset "
            "for no limit"
        )
    return seconds


class Terminated(Exception):
    """This process got SIGTERM (a cancelled CI step) while pytest ran in its own session."""


def _terminated(signum, frame) -> None:
    raise Terminated


def before_tests(limit: float, spent: float) -> str:
    """The one-line reason of a stage whose limit ran out before its tests started."""
    return (
        f"the stage's time limit ran out ({limit:g} s, {LIMIT_VAR}) before its tests started: its "
        f"build and collection took {spent:.0f} s; build first (python -m flashmoe_science build) "
        "or raise the limit"
    )


def run(cmd: list[str], cwd: Path, env: dict[str, str], limit: float, spent: float = 0.0) -> int:
    """Run `cmd` (pytest on workers) in a session of its own; past `limit` seconds of the stage, of
    which `spent` went before this call (its build, its collection), stop it as the module's
    docstring says and return pytest's interrupted status (2) unless it exited itself.
    Its own session keeps a signal to this process from reaching it, so Ctrl-C is passed on, and
    SIGTERM takes the session down before this process exits (143): a cancelled job leaves no
    worker holding the GPU."""
    try:
        previous = signal.signal(signal.SIGTERM, _terminated)
    except ValueError:  # not the main thread: SIGTERM stays as it was
        previous = None
    try:
        with subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True) as proc:
            try:
                return proc.wait(timeout=max(0.0, limit - spent))
            except subprocess.TimeoutExpired:
                before = f"; {spent:.0f} s of it before the tests started" if spent >= 1 else ""
                print(
                    f"test: the time limit ran out ({limit:g} s, {LIMIT_VAR}{before}): every "
                    "worker prints its threads' stacks and the tests still running are named below",
                    file=sys.stderr,
                    flush=True,
                )
                _signal_group(proc.pid, SIGNAL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=GRACE_S)
                return 2
            except KeyboardInterrupt:  # Ctrl-C reaches this process alone: pass it on to pytest's
                _signal_group(proc.pid, signal.SIGINT)
                return proc.wait()
            except Terminated:
                _signal_group(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=GRACE_S)
                raise SystemExit(128 + signal.SIGTERM) from None
            finally:
                _signal_group(proc.pid, signal.SIGKILL)  # what is left of the session
                proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def running_text(running: dict[str, float], now: float | None = None) -> list[str]:
    """`nodeid (for N s)`, longest running first."""
    now = time.monotonic() if now is None else now
    order = sorted(running.items(), key=lambda item: item[1])
    return [f"{nodeid} (for {now - started:.0f} s)" for nodeid, started in order]


def reason(limit_text: str, lines: list[str]) -> str:
    """The record's one-line reason for a run stopped at the limit."""
    if not lines:
        return (
            f"the stage's time limit ran out ({limit_text} s, {LIMIT_VAR}) with no test running "
            "(a worker starting or ending); the workers' stacks are in the stage's output"
        )
    shown = "; ".join(lines[:NAMED_MAX])
    more = f"; and {len(lines) - NAMED_MAX} more" if len(lines) > NAMED_MAX else ""
    return (
        f"the stage's time limit ran out ({limit_text} s, {LIMIT_VAR}) with "
        f"{len(lines)} test{'' if len(lines) == 1 else 's'} still running: {shown}{more}; "
        "their stacks are in the stage's output"
    )


class Watch:
    """Installed by the gate plugin where LIMIT_VAR is set: on a worker, SIGNAL prints every
    thread's stack to the stderr pytest started with; on the controller, it calls `on_signal`
    (which names the running tests and writes the record) and exits the process. One a process:
    a pytest session that a test runs inside a worker (LIMIT_VAR is in its environment too)
    leaves the worker's in place."""

    active: Watch | None = None  # the process's installed one

    def __init__(self, worker: bool, on_signal: Callable[[], None]) -> None:
        self.worker = worker
        self.on_signal = on_signal
        self.fd: int | None = None
        self.installed = False
        self.previous = None

    def install(self) -> None:
        if Watch.active is not None:
            return
        Watch.active = self
        if self.worker:
            # fd 2 is the real stderr here (pytest's capture starts per test, later); a test's
            # capture would swallow a dump written to the fd it redirects
            self.fd = os.dup(2)
            faulthandler.register(SIGNAL, file=self.fd, all_threads=True)
            return
        try:
            self.previous = signal.signal(SIGNAL, self._handle)
            self.installed = True
        except ValueError:  # not the main thread (pytest.main from a thread): no limit here
            Watch.active = None

    def _handle(self, signum, frame) -> None:
        try:
            self.on_signal()
        finally:
            sys.stderr.flush()
            os._exit(2)

    def uninstall(self) -> None:
        if Watch.active is not self:
            return
        Watch.active = None
        if self.worker and self.fd is not None:
            faulthandler.unregister(SIGNAL)
            os.close(self.fd)
            self.fd = None
        elif self.installed:
            signal.signal(SIGNAL, self.previous if self.previous is not None else signal.SIG_DFL)
            self.installed = False


def child_watch() -> tuple[dict[str, str], tuple[int, ...]]:
    """What a test hands a child process it starts (environment entries and subprocess's pass_fds)
    so that the child, calling watch_as_child() first, prints its stacks at the limit where its
    worker does. Nothing outside a worker watched under a limit."""
    watch = Watch.active
    if watch is None or not watch.worker or watch.fd is None:
        return {}, ()
    return {STACK_FD_VAR: str(watch.fd)}, (watch.fd,)


def watch_as_child() -> None:
    """In a child started with child_watch()'s hand-over: SIGNAL prints every thread's stack to the
    worker's stderr (faulthandler, as the worker's own Watch) instead of ending the process. The
    variable goes: a process this one starts does not hold the descriptor, whose number may name
    another file there."""
    fd = os.environ.pop(STACK_FD_VAR, "")
    if fd.isdigit():
        faulthandler.register(SIGNAL, file=int(fd), all_threads=True)
