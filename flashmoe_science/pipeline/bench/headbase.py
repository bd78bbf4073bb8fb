"""Head against base (`bench --base REF`): two builds, two worker processes, alternating requests,
and a verdict per case.

REF is checked out as a git worktree in <build root>/worktrees/<sha12> and built by its own
`python -m flashmoe_science build` into its own build root (<sha12>.build beside it): two builds of
one torch library namespace cannot share a process. One worker per side,
`python -m flashmoe_science bench --worker` started in its tree (the command line every version of
the package has had, so commits from before any module moved still serve), times one case per
JSON-lines request. Requests alternate base, head, base, head, ... for --rounds rounds per case, so
drift of clocks or temperature hits both sides alike; stats.decide judges each case.

When the base cannot be timed (its tree has no bench command, it does not build, or its worker
dies), the comparison falls back to a stored result for this GPU model (history.py), else records
that there is none, with the reason either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ... import _loader
from .. import exitcodes, paths, provenance
from ..basetree import (  # the base side, which `build --base` shares
    BENCH_MODULE_PATHS,
    BaseUnavailable,
    base_build_failed,
    commit_has_bench,
    prepare_worktree,
    resolve_ref,
    side_env,
    start_base_build,
    tree_has_bench,
)
from ..cases import Case, Inputs, make_inputs
from . import history, stats
from .baselines import ops, our_call
from .records import BaseRef, BenchRecord, CaseVerdict, Comparison, MissingVerdict
from .stats import sig
from .timing import TimingConfig, benchmark, make_timer

# Version of the JSON-lines protocol below. Requests: {"op": "time", "case": Case.to_dict(),
# "samples": N} or {"op": "quit"}; a worker keeps the case fields it knows, so heads and workers of
# different versions understand each other. Replies: {"ok": true, "samples_ms": [...]} or
# {"ok": false, "error": "..."}; the first line is {"ready": true, "protocol": 1, ...}.
WORKER_PROTOCOL = 1


class WorkerError(RuntimeError):
    """One request failed (the case does not run on that side); the worker lives on."""


class WorkerDied(RuntimeError):
    """The worker process is gone or speaks another protocol."""


def worker_command(device: str, timing_args: Sequence[str] = ()) -> list[str]:
    """The package's CLI, not a module path: module paths move between versions, the CLI stays."""
    return [
        sys.executable,
        "-m",
        "flashmoe_science",
        "bench",
        "--worker",
        "--backend",
        device,
        *timing_args,
    ]


class Worker:
    """A `python -m flashmoe_science bench --worker` process in one tree, speaking JSON lines."""

    def __init__(
        self, name: str, tree: Path, env: dict, device: str, timing_args: Sequence[str] = ()
    ):
        self.name = name
        self.process = subprocess.Popen(
            worker_command(device, timing_args),
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        hello = self._receive()
        if hello.get("protocol") != WORKER_PROTOCOL:
            self.close()
            raise WorkerDied(
                f"{name} worker speaks protocol {hello.get('protocol')}, we speak {WORKER_PROTOCOL}"
            )

    def _receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise WorkerDied(
                f"the {self.name} worker exited ({code}); its errors are printed above"
            )
        return json.loads(line)

    def time(self, case: Case, samples: int) -> list[float]:
        try:
            self.process.stdin.write(
                json.dumps({"op": "time", "case": case.to_dict(), "samples": samples}) + "\n"
            )
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDied(f"the {self.name} worker is gone: {exc}") from exc
        reply = self._receive()
        if not reply.get("ok"):
            raise WorkerError(reply.get("error", "unknown error"))
        return reply["samples_ms"]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def worker_main(device: str, config: TimingConfig) -> int:
    """Serve timing requests on stdin/stdout, one JSON object per line, until {"op": "quit"}."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    # build chatter and prints must not corrupt the protocol
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    ops().load_library()
    timer = make_timer(device)
    send({"ready": True, "protocol": WORKER_PROTOCOL, "device": device, "pid": os.getpid()})
    current: tuple[Case, Inputs] | None = None
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") != "time":
            break
        try:
            case = Case.from_dict(request["case"])
            if current is None or current[0] != case:
                current = None  # free the previous inputs before allocating the next ones
                if device == "cuda":
                    torch.cuda.empty_cache()
                current = (case, make_inputs(case, device))
            fn = our_call(case, current[1])
            timing = benchmark(fn, timer, config, samples=int(request["samples"]))
            send({"ok": True, "samples_ms": [sig(t) for t in timing.samples_ms]})
        except Exception as exc:  # the case fails on this side: report it, keep serving
            send({"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
    return exitcodes.OK


# --------------------------------------------------------------------------------------------------
# Alternation and verdicts
# --------------------------------------------------------------------------------------------------


def interleaved_order(rounds: int) -> list[str]:
    """base, head, base, head, ...: both sides see the same drift of clocks and temperature."""
    return ["base", "head"] * rounds


def compare_interleaved(
    cases: Sequence[Case],
    workers: dict,
    rounds: int,
    samples_per_round: int,
    threshold: float,
    alpha: float,
    say=print,
) -> list[CaseVerdict | MissingVerdict]:
    """Time every case on both workers in alternation and decide each with stats.decide."""
    results = []
    start = time.monotonic()
    for index, case in enumerate(cases, 1):
        samples: dict[str, list[float]] = {"base": [], "head": []}
        try:
            for side in interleaved_order(rounds):
                samples[side].extend(workers[side].time(case, samples_per_round))
        except WorkerError as exc:
            results.append(MissingVerdict(case.id, f"{side}: {exc}"[:600]))
            say(f"[{index}/{len(cases)}] compare {case.id} ... missing ({side}: {str(exc)[:120]})")
            continue
        verdict = stats.decide(samples["base"], samples["head"], threshold, alpha)
        results.append(CaseVerdict.of(case.id, verdict))
        elapsed = time.monotonic() - start
        say(
            f"[{index}/{len(cases)}] compare {case.id} ... {verdict_text(verdict)} "
            f"({elapsed:.1f} s elapsed)"
        )
    return results


def verdict_text(verdict: stats.Verdict) -> str:
    p = f"p={verdict.p_value:.2g}" if verdict.p_value is not None else "too few samples for a test"
    return (
        f"base {verdict.base.median:.4g} ms, head {verdict.head.median:.4g} ms: {verdict.verdict} "
        f"({(verdict.ratio - 1) * 100:+.1f}%, {p})"
    )


# --------------------------------------------------------------------------------------------------
# The base's tree, build and environment
# --------------------------------------------------------------------------------------------------


def reuse_head_build(tree: Path, env: dict) -> bool:
    """Seed the base's build root with this process's build of the same defines when the base's
    kernel sources hash the same (a change to Python alone): its build then compiles nothing."""
    try:
        config = _loader.resolve_config(
            defines=_loader.split_defines(env.get(_loader.DEFINES_VAR, ""))
        )
    except _loader.ConfigError:
        return False  # the base's own build says why
    return _loader.reuse_build(config, tree / "csrc", Path(env["FLASHMOE_BUILD_ROOT"]))


def build_base(tree: Path, env: dict, log_path: Path, say=print) -> None:
    if reuse_head_build(tree, env):
        say("bench: the base's kernel sources are the head's: it reuses the head's build")
    say(f"bench: building the base in {tree} into {env['FLASHMOE_BUILD_ROOT']} (log {log_path})")
    code = start_base_build(tree, env, log_path).wait()
    if code != 0:
        raise base_build_failed(code, log_path)


def base_dirs(tree: Path, sha: str | None) -> tuple[Path, Path]:
    """(build root, report dir) of the base, beside the worktree (one definition: paths.base_dirs,
    which the workflow asks through `python -m flashmoe_science.pipeline.paths base-report`)."""
    return paths.base_dirs(tree, sha)


def compare_with_tree(
    tree: Path, sha: str | None, cases, device, args, say=print
) -> list[CaseVerdict | MissingVerdict]:
    if not tree_has_bench(tree):
        raise BaseUnavailable(
            f"the base tree has no bench command (none of {', '.join(BENCH_MODULE_PATHS)} in "
            f"{tree})"
        )
    if device == "cpu":
        say(
            "bench: note: on the CPU backend, separate processes running identical code have been "
            "measured up to 2x apart (2-vCPU VM); read CPU verdicts as a check of the plumbing"
        )
    build_root, base_reports = base_dirs(tree, sha)
    base_reports.mkdir(parents=True, exist_ok=True)
    env = side_env(tree, build_root, base_reports, getattr(args, "base_defines", None))
    build_base(tree, env, base_reports.parent / f"{build_root.name}.log", say)
    timing_args = []
    for flag, value in (("--warmup-ms", args.warmup_ms), ("--rep-ms", args.rep_ms)):
        timing_args += [flag, str(value)] if value is not None else []
    if device == "cuda":
        torch.cuda.empty_cache()  # leave the card's memory to the two workers
    workers = {}
    try:
        workers["base"] = Worker("base", tree, env, device, timing_args)
        workers["head"] = Worker(
            "head", paths.REPO_ROOT, side_env(paths.REPO_ROOT, None, None), device, timing_args
        )
        samples = args.samples_per_round or (20 if device == "cuda" else 3)
        say(
            f"bench: comparing {len(cases)} cases: {args.rounds} rounds of base, head "
            f"x {samples} calls"
        )
        return compare_interleaved(
            cases, workers, args.rounds, samples, args.threshold / 100, args.alpha, say
        )
    except WorkerDied as exc:
        raise BaseUnavailable(str(exc)) from exc
    finally:
        for worker in workers.values():
            worker.close()


def comparison_record(
    source: str,
    base: BaseRef,
    results: list[CaseVerdict | MissingVerdict] | None,
    args,
    reason: str | None = None,
) -> Comparison:
    verdicts = [r.verdict for r in results or ()]
    return Comparison(
        source=source,
        base=base,
        reason=reason,
        threshold=args.threshold / 100,
        alpha=args.alpha,
        rounds=args.rounds if source == "worktree" else None,
        summary={
            v: verdicts.count(v)
            for v in (stats.REGRESSION, stats.IMPROVEMENT, stats.NO_CHANGE, "missing")
        },
        cases=results or [],
    )


def compare(record: BenchRecord, cases: Sequence[Case], device: str, args, say=print) -> Comparison:
    """Head against --base REF (or --base-dir DIR) side by side, else against the stored run of the
    base (or its newest stored ancestor), else nothing; the record says which and why."""
    if args.base_dir:
        tree: Path | None = Path(args.base_dir).resolve()
        sha = provenance.commit(tree)["sha"]
        base = BaseRef(ref=str(tree), sha=sha)
    else:
        tree, sha = None, resolve_ref(args.base)
        base = BaseRef(ref=args.base, sha=sha)
    base_defines = getattr(args, "base_defines", None)
    if base_defines is not None:
        wanted = _loader.split_defines(base_defines)
        if wanted != _loader.env_defines():
            base.defines = list(wanted)
    try:
        if tree is None:
            if not commit_has_bench(sha):  # no worktree needed to know
                raise BaseUnavailable(f"the base {sha[:12]} has no bench command (no bench.py)")
            tree = prepare_worktree(sha)
        results = compare_with_tree(tree, sha, cases, device, args, say)
        return comparison_record("worktree", base, results, args)
    except BaseUnavailable as exc:
        reason = str(exc)
    say(f"bench: cannot time the base side by side: {reason}")
    entries = history.load_history(
        history.history_path(history.history_dir(args.history), record.gpu)
    )
    stored = history.stored_reference(entries, sha) if sha else None
    if stored is None:
        say("bench: nothing stored for the base or its ancestors on this machine: no comparison")
        return comparison_record("none", base, None, args, f"{reason}; nothing stored either")
    say(f"bench: comparing with the stored run of {stored['commit'][:12]} ({stored['timestamp']})")
    base.stored_commit = stored["commit"]
    base.stored_at = stored["timestamp"]
    base.stored_torch = stored.get("torch")
    results = history.compare_with_stored(stored, record, args.threshold / 100, args.alpha)
    return comparison_record("stored", base, results, args, reason)
