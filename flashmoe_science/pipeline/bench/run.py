"""`python -m flashmoe_science bench` (`nox -s bench -- ARGS`): time our kernels against PyTorch's
SDPA, and optionally the head of the tree against a base commit.

    python -m flashmoe_science bench              # default matrix (scaled down on the CPU backend)
    python -m flashmoe_science bench --quick      # a handful of cases, one per speed-target kind
    python -m flashmoe_science bench --pr --base main   # a pull request's: one case per family
    python -m flashmoe_science bench --case 'dec-*'   # ids or globs; --list prints the selection
    python -m flashmoe_science bench --base main --fail-on-regression
    git bisect run nox -s bench -- --bisect CASE --max-ms T

Timing, as triton.testing.do_bench does it (without depending on triton): CUDA events around each
call; a 256 MB write (`zero_` of an int32 buffer) before every timed call, so each starts from a
cold L2; a warm-up of ~25 ms (at least 3 calls) without flushing; then up to 100 timed calls in a
~100 ms budget. The median and the interquartile range are reported. On the CPU backend:
time.perf_counter, no flush, fewer calls: those numbers check the plumbing and say nothing about a
GPU. Inputs are torch.randn, seeded per case (flashmoe_science.pipeline.cases).

Baselines, in the same process: F.scaled_dot_product_attention with each backend forced through
torch.nn.attention.sdpa_kernel (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION), and with its
own choice ("sdpa-default"). Ours and the baselines are timed in turn over interleaved rounds
(flashmoe_science.pipeline.bench.measure.ROUNDS, every other round in reverse), so drift during a case
hits every column alike. A backend that refuses a case is recorded as "unsupported" with its
reason. "ratio" is SDPA's time / ours: above 1, ours is faster. FlashAttention-3 and -4
(pipeline.bench.peers, columns "fa3" and "fa4") join the prefill and backward kinds' rounds where
they import and the card runs them, else each case says why not ("not installed: ..."); an
automatic backward case also times our kernel with deterministic=True ("ours_deterministic").
The cases with a sliding window, softcap or sinks (the "features" group: matrix.feature_cases)
have FlexAttention under torch.compile as their baseline ("flex", pipeline.bench.flex; SDPA and
the peers say why not); on the CPU backend it is not timed, nor in the pull request's subset. A case our kernels refuse here (ours
"unsupported") fails nothing and is left out of --base.

Read floor (decode cases on CUDA, "read_floor"): the fastest of a few Triton kernels that only read
the case's K and V, timed in the same interleaved rounds as ours and the baselines
(flashmoe_science.pipeline.bench.readfloor). No decode kernel is expected
to beat it by much, so SDPA's time over it bounds what any kernel can gain on SDPA there; its
"ratio" is its time / ours (1 would be a decode as fast as a bare read).

Speed targets (pipeline.bench.target_cases; after the matrix, selected by `--case` like it): varlen
(`varlen-*`: a packed batch of mixed lengths against our dense kernel run once per distinct length,
in one timing window), paged decode (`paged-*`: a shuffled block table against the same contents
contiguous, both with the read floor), host cost (`host-*`: the time per call of 2,000 back-to-back
calls without a synchronisation, CUDA events around the loop, beside SDPA's equivalent call) and the
small Llama-style model (`model-*`: prefill and greedy decoding with our attention and with SDPA's)
and a 4-layer one's training step (`step-*`: forward, backward and AdamW, our attention against
SDPA's from the same initialisation, in the same interleaved rounds; tokens/s) and a Gemma-2-style
model trained with our attention and with eager from one initialisation (`loss-*`: the final
losses; 5 steps on the CPU).
Their records go to bench.json's "targets"; pipeline.bench.targets judges each ratio against its target
(and the read floor of every matrix decode case of at least 64 MiB, and the targets of the card the
run is on), for bench.md and the report. On the CPU backend the host-cost and model cases are
"unsupported" records, the training step runs on a tiny model, and nothing is judged. Only our
kernel failing on a speed case fails the run; a missed target does not.

Head against base (`--base REF`): REF is checked out as a git worktree in
<build root>/worktrees/<sha12> and built by its own `python -m flashmoe_science build` into its own
build root (<sha12>.build beside it): two builds of one torch library namespace cannot share a
process. One worker process per side (`python -m flashmoe_science bench --worker`, started in its
tree) times one case per JSON-lines request. Requests alternate base, head, base, head, ... for
--rounds rounds per case, so drift of clocks or temperature hits both sides alike. A case is a
"regression" or an "improvement" only when the medians differ by more than --threshold percent AND
a Mann-Whitney U test gives p < --alpha (flashmoe_science.pipeline.bench.stats, after asv), so identical code comes
out "no change" on a GPU. (On the CPU backend, separate processes running identical code were
measured up to 2x apart on a 2-vCPU VM: CPU comparisons check the plumbing only.) `--base-dir DIR`
uses an existing checkout as the base instead of a worktree.

When the base cannot be timed (its tree has no bench module, it does not build, or its worker dies),
the comparison falls back to a stored result for this GPU model. Every full default-matrix run of a
clean tree appends its raw samples to <build root>/bench-history/<gpu-model>.json (the last 20 runs;
--history DIR or FLASHMOE_BENCH_HISTORY moves it; CI can cache that folder). The stored run used is
REF's own, else the newest one of an ancestor of REF. bench.json says comparison.source = "stored"
(samples from another run: machine drift is not controlled), or "none" when nothing is stored, and
gives the reason either way.

Bisecting a slowdown (the `git bisect run` contract; asv find does the same with a threshold):
    git bisect start BAD GOOD
    git bisect run nox -s bench -- --bisect fwd-bf16-d128-h16-b4-s4096-causal --max-ms 1.25
exits 0 when the case's median is below --max-ms (good), 1 when it is not (bad), 125 when the commit
cannot be built or the case does not run on it (skip), and 255 when the environment is broken, e.g.
no GPU, which aborts the bisect instead of blaming commits. Pick --max-ms between the good and the
bad timings measured on the same machine. Every commit bisected needs this bench command: older ones
fail in a way git bisect counts as bad, so bisect older ranges with a driver script kept outside the
tree. --backend cpu bisects CPU timings on a machine without a GPU.

Exit codes (flashmoe_science.pipeline.exitcodes): 0 ok; 1 a regression with --fail-on-regression, or our
kernel failed on a case; 2 usage; 125 this checkout does not build; 255 environment broken (no
torch, no GPU for --backend cuda or --bisect, running under pytest-xdist).

Output: <report dir>/bench.json (schema "flashmoe-science/bench/1", benches/bench.schema.json,
validated when written; records.load reads it back) and <report dir>/bench.md, both removed
before a run starts. Worker requests have no timeout: the CI job's timeout bounds a hung worker.

Where the parts live (flashmoe_science.pipeline.cases, and beside this module in bench/): cases
(Case, ids, inputs), matrix (the matrix), timing (timers, benchmark, ceilings), baselines (our
call, SDPA), flex (FlexAttention), measure (one case into a record), machine, headbase
(worktree, workers, verdicts),
history (stored runs), records (bench.json), summary (bench.md), target_cases and target_measure
(the speed-target cases and their measurement), targets (their verdicts), smallmodel (the
models of the model, step and loss cases). This module is the command line and the order of the steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from collections.abc import Sequence

import torch

from ... import _loader
from .. import exitcodes, load, paths, provenance
from ..cases import Case, make_inputs, parse_case_id
from ..cli import program
from . import headbase, history, machine, stats, targets
from . import records as benchrecords
from . import summary as benchmd
from .baselines import Abort, build_checkout, first_call, our_call
from .matrix import default_matrix, select
from .measure import ROUNDS, run_case
from .records import (
    BenchRecord,
    Ceilings,
    Commit,
    Gpu,
    MachineLoad,
    Measured,
    NotMeasured,
    TimingSetup,
)
from .target_cases import Target
from .target_measure import run_target
from .timing import TimingConfig, benchmark, first_line, make_timer, measure_ceilings, xdist_problem

OUTPUTS = ("bench.json", "bench.md")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_matrix(
    cases: Sequence[Case],
    device: str,
    config: TimingConfig,
    baselines: bool,
    say=print,
    target_cases: Sequence[Target] = (),
    flex_column: bool = True,
) -> BenchRecord:
    """Every case and target case measured into the run's record; `flex_column` off leaves
    FlexAttention out (the pull request's subset)."""
    timer = make_timer(device)
    gpu = machine.gpu_info(device)
    around = load.start()
    start = time.monotonic()
    where = gpu["name"] if gpu else "the CPU"
    total = len(cases) + len(target_cases)
    say(f"bench: {total} cases on {where} ({timer.method}); measuring ceilings")
    ceilings = measure_ceilings(device, timer, config)
    block = provenance.provenance()
    commit = block["commit"]
    record = BenchRecord(
        provenance=block,
        timestamp=_now(),
        backend=device,
        gpu=Gpu(**gpu) if gpu else None,
        driver=machine.driver_version() if device == "cuda" else None,
        **machine.versions(device),
        commit=Commit(commit["sha"], commit["dirty"]) if commit["sha"] else None,
        timing=TimingSetup(
            timer.method,
            timer.flush_bytes,
            **dataclasses.asdict(config),
            rounds=ROUNDS,
            unstable_spread=stats.UNSTABLE_SPREAD,
            min_sample_ms=getattr(timer, "min_sample_ms", None),
        ),
        ceilings=Ceilings.from_json(ceilings),
        cases=[],
        defines=list(_loader.env_defines()) or None,
    )
    for index, case in enumerate(cases, 1):
        entry = run_case(
            case, device, timer, config, ceilings, baselines, say=say, flex_column=flex_column
        )
        record.cases.append(entry)
        elapsed = time.monotonic() - start
        say(f"[{index}/{total}] {case.id} ... {_progress_text(entry)} ({elapsed:.1f} s elapsed)")
    if target_cases:
        record.targets = []
    for index, target in enumerate(target_cases, len(cases) + 1):
        entry = run_target(target, device, timer, config, ceilings, say=say)
        record.targets.append(entry)
        if device == "cuda":
            torch.cuda.empty_cache()
        elapsed = time.monotonic() - start
        say(f"[{index}/{total}] {target.id} ... {_target_text(entry)} ({elapsed:.1f} s elapsed)")
    around = load.finish(around)
    record.load = MachineLoad(**around)
    busy = load.busy(around) if device == "cpu" else None
    if busy:
        say(f"bench: {busy}: busy cores, so these CPU timings are not judged ({load.RERUN})")
    return record


def _target_text(entry) -> str:
    ours = entry.ours
    if isinstance(ours, NotMeasured):
        return f"{ours.status.upper()}: {ours.reason[:160]}"
    found = targets.target_verdicts(entry, cpu=False)
    ratios = [f"{v.what} {v.ratio:.3g}x" for v in found if v.ratio is not None]
    if entry.kind == "model" and entry.decode_ratio is not None:
        ratios.append(f"decode tokens/s ours / SDPA {entry.decode_ratio:.3g}x")
    if entry.kind == "loss" and entry.ratio is not None:
        ratios = [
            f"final loss ours {entry.ours.final_loss:.5g}, eager {entry.eager.final_loss:.5g} "
            f"(ours / eager {entry.ratio:.4g})"
        ]
    return ", ".join(ratios) or "measured"


def _progress_text(entry) -> str:
    ours = entry.ours
    if not isinstance(ours, Measured):
        return f"{ours.status.upper()}: {ours.reason[:160]}"
    text = f"{ours.median_ms:.4g} ms"
    default = entry.baselines.get("sdpa-default")
    if isinstance(default, Measured) and default.ratio:
        text += f" (sdpa-default {default.median_ms:.4g} ms, x{default.ratio:.3g})"
    if entry.unstable:
        text += f"; still unstable: {', '.join(entry.unstable)}, not judged"
    return text


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def choose_device(backend: str, bisect: bool) -> str:
    if backend != "cpu" and torch.cuda.is_available():
        return "cuda"
    if backend == "cuda" or (backend == "auto" and paths.require_gpu_from_env()):
        required = "--backend cuda" if backend == "cuda" else "FLASHMOE_REQUIRE_GPU=1"
        raise Abort(exitcodes.ENV_BROKEN, f"{required} but torch sees no GPU; check `nvidia-smi`")
    if bisect and backend == "auto":
        raise Abort(
            exitcodes.ENV_BROKEN,
            "--bisect without a GPU: no timing here is comparable to --max-ms (exit 255 stops the "
            "bisect); pass --backend cpu to bisect CPU timings",
        )
    return "cpu"


def _threshold(text: str) -> float:
    value = float(text.rstrip("%"))
    if value < 0:
        raise argparse.ArgumentTypeError("the threshold is a percentage >= 0, e.g. 5")
    return value


def _retakes(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"the retakes are a whole number >= 0, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{program()} bench",
        description="Time our attention kernels against PyTorch SDPA; optionally the head against "
        "a base commit (--base), or one case against a limit for `git bisect run` (--bisect).",
    )
    subset = p.add_mutually_exclusive_group()
    subset.add_argument(
        "--quick",
        action="store_true",
        help="a handful of cases: 2 prefill, 1 decode, 1 small, 1 backward, 1 per speed-target kind",
    )
    subset.add_argument(
        "--pr",
        action="store_true",
        help="the pull request's subset: one case per kernel family of the matrix (its bf16, causal "
        "case at the middle length) and --quick's target cases; the matrix's geomean targets are "
        "not judged on it, and its feature cases time no FlexAttention (pushes to main and the "
        "nightly run time the whole matrix, FlexAttention included)",
    )
    p.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="ID",
        help="case id or glob, repeatable (see --list)",
    )
    p.add_argument("--list", action="store_true", help="print the selected case ids and exit")
    p.add_argument(
        "--backend",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="device to time on (auto: the GPU if torch sees one); cpu gives a scaled-down matrix",
    )
    p.add_argument("--no-baselines", action="store_true", help="skip the SDPA baselines")
    p.add_argument(
        "--warmup-ms",
        type=float,
        help="warm-up budget per measurement (default 25 on CUDA, 10 on CPU)",
    )
    p.add_argument(
        "--rep-ms",
        type=float,
        help="timed-call budget per measurement (default 100 on CUDA, 150 on CPU)",
    )
    p.add_argument(
        "--retakes",
        type=_retakes,
        help="times a disturbed case is timed again, all columns (default 2; 0 for a run that "
        "checks the plumbing, not the figures)",
    )
    g = p.add_argument_group("head against base")
    g.add_argument(
        "--base",
        metavar="REF",
        help="git ref to compare against (worktree, own build, interleaved workers)",
    )
    g.add_argument(
        "--base-dir",
        metavar="DIR",
        help="compare against an existing checkout instead of a worktree of REF",
    )
    g.add_argument(
        "--base-defines",
        metavar="LIST",
        help="the base side's extra -D defines, comma-separated ('' for none; default: the head's, "
        "FLASHMOE_BUILD_DEFINES): with --base-dir . it times a compile-time switch against itself",
    )
    g.add_argument(
        "--rounds", type=int, default=5, help="base/head alternations per case (default 5)"
    )
    g.add_argument(
        "--samples-per-round",
        type=int,
        help="timed calls per request (default 20 on CUDA, 3 on CPU)",
    )
    g.add_argument(
        "--threshold",
        type=_threshold,
        default=stats.DEFAULT_THRESHOLD * 100,
        metavar="PCT",
        help="smallest change in the median that counts, in percent (default 5)",
    )
    g.add_argument(
        "--alpha",
        type=float,
        default=stats.DEFAULT_ALPHA,
        help="Mann-Whitney significance level (default 0.01)",
    )
    g.add_argument(
        "--fail-on-regression", action="store_true", help="exit 1 when any case regresses"
    )
    g.add_argument(
        "--history", metavar="DIR", help="stored results (default <build root>/bench-history)"
    )
    g.add_argument(
        "--no-history", action="store_true", help="do not record this run in the stored results"
    )
    b = p.add_argument_group("bisect (git bisect run)")
    b.add_argument(
        "--bisect", metavar="CASE", help="time only CASE; exit 0 if its median < --max-ms, else 1"
    )
    b.add_argument("--max-ms", type=float, help="the limit for --bisect, in milliseconds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _check_args(p: argparse.ArgumentParser, args) -> None:
    if args.bisect and args.max_ms is None:
        p.error("--bisect CASE needs --max-ms T")
    if args.max_ms is not None and not args.bisect:
        p.error("--max-ms goes with --bisect CASE")
    if args.base and args.base_dir:
        p.error("give --base REF or --base-dir DIR, not both")
    if args.base_defines is not None:
        if not (args.base or args.base_dir):
            p.error("--base-defines goes with --base REF or --base-dir DIR")
        try:
            _loader.normalize_defines(_loader.split_defines(args.base_defines))
        except _loader.ConfigError as exc:
            p.error(f"--base-defines: {exc}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")


def bisect_main(case: Case, max_ms: float, device: str, config: TimingConfig) -> int:
    """Exit 0 when the case's median is below max_ms, 1 when not, 125 when it cannot run here."""
    fn = our_call(case, make_inputs(case, device))
    problem = first_call(fn)
    try:
        timing = benchmark(fn, make_timer(device), config) if problem is None else None
    except RuntimeError as exc:
        problem = first_line(exc)
    if timing is None:  # the kernel fails on this commit: it cannot be judged on speed
        print(f"bench --bisect: {case.id} does not run here ({problem[:300]}); exit 125 (skip)")
        return exitcodes.BUILD_FAILED
    good = timing.median_ms < max_ms
    print(
        f"bench --bisect: {case.id} median {timing.median_ms:.4g} ms "
        f"(IQR {timing.iqr_ms:.2g}, n={timing.summary.n}) {'<' if good else '>='} {max_ms} ms: "
        f"{'good' if good else 'bad'}"
    )
    return exitcodes.OK if good else exitcodes.GATE_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    try:
        return run(args)
    except Abort as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return exc.exit_code


def run(args) -> int:
    if not args.list and (problem := xdist_problem()):  # listing times nothing
        raise Abort(exitcodes.ENV_BROKEN, problem)
    device = choose_device(args.backend, bool(args.bisect))
    config = TimingConfig.for_device(device, args.warmup_ms, args.rep_ms, args.retakes)
    if args.worker:
        return headbase.worker_main(device, config)
    try:
        bisect_case = parse_case_id(args.bisect) if args.bisect else None
        cases, target_cases = (
            ([], []) if args.bisect else select(device, args.quick, args.case, args.pr)
        )
    except ValueError as exc:
        raise Abort(exitcodes.USAGE, str(exc)) from exc
    if args.list:
        print("\n".join([c.id for c in cases] + [t.id for t in target_cases]))
        return exitcodes.OK
    if bisect_case is None and (problem := benchrecords.validator_problem()):
        raise Abort(exitcodes.ENV_BROKEN, f"{problem}; nothing was timed")
    if args.base and not headbase.resolve_ref(args.base):
        raise Abort(
            exitcodes.USAGE, f"--base {args.base!r} is not a commit here (`git log --oneline`)"
        )
    if bisect_case is None:  # a run that stops early (no build: 125) leaves no older result behind
        provenance.clear_outputs(*OUTPUTS)
    build_checkout(device)
    if bisect_case is not None:
        return bisect_main(bisect_case, args.max_ms, device, config)
    return run_and_report(args, cases, device, config, target_cases)


def run_and_report(
    args, cases: list[Case], device: str, config: TimingConfig, target_cases: Sequence[Target] = ()
) -> int:
    record = run_matrix(
        cases,
        device,
        config,
        baselines=not args.no_baselines,
        target_cases=target_cases,
        flex_column=not args.pr,
    )
    record.subset = subset_of(args)
    record.partial_groups = targets.partial_groups(cases, default_matrix(device)) or None
    if args.base or args.base_dir:
        # a case our kernels refuse here has no time to compare
        refused = {c.id for c in record.cases if _refused(c)}
        compared = [c for c in cases if c.id not in refused]
        record.comparison = headbase.compare(record, compared, device, args)
    # after the comparison, so a fallback to stored results never finds this very run
    if record.subset is None and not args.no_history and record.commit and not record.commit.dirty:
        stored = history.record_history(record, history.history_dir(args.history))
        print(f"bench: recorded in {stored}")
    out = paths.report_dir()
    benchrecords.write(record, out / "bench.json")
    (out / "bench.md").write_text(benchmd.render_markdown(record))
    print(f"bench: wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return verdict_exit_code(record, args.fail_on_regression)


def subset_of(args) -> str | None:
    """Which subset of the matrix the run timed (BenchRecord.subset); None: the whole matrix."""
    if args.case:
        return benchrecords.CASES
    if args.quick:
        return benchrecords.QUICK
    return benchrecords.PULL_REQUEST if args.pr else None


def _target_failed(target) -> bool:
    """Our kernel (either of our sides) failed; "unsupported" (no CUDA here) is not a failure."""
    ours = [target.ours] + [getattr(target, name, None) for name in ("dense", "contiguous")]
    return any(isinstance(r, NotMeasured) and r.status == "error" for r in ours)


def _refused(case) -> bool:
    """Our kernels refused the case here (ours "unsupported")."""
    return isinstance(case.ours, NotMeasured) and case.ours.status == "unsupported"


def _case_failed(case) -> bool:
    """Our kernel failed on a matrix case: its default call, or its deterministic one. A refusal
    ("unsupported") is not a failure; its targets say "not judged" with the reason."""
    deterministic = case.ours_deterministic
    failed = isinstance(deterministic, NotMeasured) and deterministic.status == "error"
    return failed or not (isinstance(case.ours, Measured) or _refused(case))


def verdict_exit_code(record: BenchRecord, fail_on_regression: bool) -> int:
    if record.targets:
        found = targets.counts(targets.verdicts(record))
        print(
            f"bench: speed targets: {found[targets.MET]} met, {found[targets.MISSED]} missed, "
            f"{found[targets.NOT_JUDGED]} not judged (bench.md lists them)"
        )
    failed = [c.id for c in record.cases if _case_failed(c)]
    failed += [t.id for t in record.targets or [] if _target_failed(t)]
    if failed:
        print(
            f"bench: our kernel failed on {len(failed)} case(s): {', '.join(failed[:5])}",
            file=sys.stderr,
        )
        return exitcodes.GATE_FAILED
    comparison = record.comparison
    if comparison:
        if comparison.source == "none":
            print(f"bench: no comparison with {comparison.base.ref}: {comparison.reason}")
        else:
            source = f"{comparison.base.ref} ({comparison.source})"
            print(f"bench: against {source}: {comparison.summary_text()}")
        if fail_on_regression and comparison.summary["regression"]:
            return exitcodes.GATE_FAILED
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
