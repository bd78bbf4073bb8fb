"""bench.json as typed records: what `bench` writes and what the report reads, defined once.

`write(record, path)` validates against benches/bench.schema.json before writing, `load(path)`
validates after reading and returns a `BenchRecord`; an invalid file raises `InvalidBenchFile`
naming the file, the first problem and what to do. Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from ..paths import BENCH_SCHEMA
from . import stats
from .stats import sig

SCHEMA = "flashmoe-science/bench/1"
SCHEMA_PATH = BENCH_SCHEMA
SUMMARY_KEYS = ("regression", "improvement", "no change", "missing")
# The SDPA baselines, in the order of the tables (baselines.BASELINES maps them to backends)
BASELINE_NAMES = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-default")
# SDPA's kernels that exist on CUDA alone: on the CPU backend their refusal reads NOT_ON_CPU
CUDA_ONLY_BASELINES = ("sdpa-cudnn", "sdpa-efficient")
NOT_ON_CPU = "not available on the CPU"
# FlashAttention-3 and -4 (pipeline.bench.peers), timed beside the SDPA baselines where importable
PEER_NAMES = ("fa3", "fa4")
PEER_LABELS = {"fa3": "FlashAttention-3", "fa4": "FlashAttention-4"}
# The reason of a peer that cannot be imported here starts with this (cells show it alone)
NOT_INSTALLED = "not installed"
# FlexAttention under torch.compile (pipeline.bench.flex): the baseline of the cases with a window,
# softcap or sinks, which SDPA cannot express
FLEX_NAME = "flex"
FLEX_LABEL = "FlexAttention"


class InvalidBenchFile(ValueError):
    """bench.json (or a record about to become one) does not follow benches/bench.schema.json."""


# Metadata of a field left out of the JSON when it is None (the schema has it as optional)
OPTIONAL = {"omit_if_none": True}
# The subsets of the matrix a run can time (BenchRecord.subset); the whole matrix is none of them
QUICK, PULL_REQUEST, CASES = "quick", "pull-request", "cases"
SUBSET_LABELS = {
    QUICK: "the --quick subset",
    PULL_REQUEST: "the pull request's subset (--pr: one case per kernel family)",
    CASES: "the cases named by --case",
}


@dataclasses.dataclass
class Gpu:
    name: str
    capability: str  # "9.0"
    sm_count: int
    memory_bytes: int


@dataclasses.dataclass
class Commit:
    sha: str
    dirty: bool  # the working tree differs from the commit (untracked files included)


@dataclasses.dataclass
class TimingSetup:
    """How every measurement of the run was taken (timing.TimingConfig and the timer)."""

    method: str  # "cuda-events" or "perf-counter"
    l2_flush_bytes: int
    warmup_ms: float
    rep_ms: float
    min_warmup: int
    min_reps: int
    max_reps: int
    estimate_calls: int
    # ours and the baselines timed in turn over this many rounds (older records: one after another)
    rounds: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # the spread rule (stats.UNSTABLE_SPREAD) and the retakes it allowed (older records: none)
    unstable_spread: float | None = dataclasses.field(default=None, metadata=OPTIONAL)
    retakes: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # CPU: each sample times back-to-back calls lasting at least this long (older records, CUDA: one)
    min_sample_ms: float | None = dataclasses.field(default=None, metadata=OPTIONAL)


@dataclasses.dataclass
class MachineLoad:
    """The CPU count and the 1-, 5- and 15-minute load averages at the run's start and end
    (pipeline.load; None where the platform has no load average)."""

    cpus: int | None
    before: list[float] | None
    after: list[float] | None


@dataclasses.dataclass
class CopyCeiling:
    bytes: int  # read plus written
    ms: float
    gbps: float


@dataclasses.dataclass
class MatmulCeiling:
    n: int
    dtype: str
    ms: float
    tflops: float


@dataclasses.dataclass
class Ceilings:
    """What the card reached on a large copy and a large matmul; `error` when they could not run."""

    copy: CopyCeiling | None = dataclasses.field(default=None, metadata=OPTIONAL)
    matmul: MatmulCeiling | None = dataclasses.field(default=None, metadata=OPTIONAL)
    error: str | None = dataclasses.field(default=None, metadata=OPTIONAL)

    @classmethod
    def from_json(cls, data: dict) -> Ceilings:
        return cls(
            copy=_build(CopyCeiling, data["copy"]) if "copy" in data else None,
            matmul=_build(MatmulCeiling, data["matmul"]) if "matmul" in data else None,
            error=data.get("error"),
        )


@dataclasses.dataclass
class Measured:
    """One implementation timed on one case."""

    median_ms: float
    q1_ms: float
    q3_ms: float
    iqr_ms: float
    n: int
    tflops: float | None
    gbps: float | None
    pct_matmul_ceiling: float | None
    pct_copy_ceiling: float | None
    peak_mem_bytes: int | None
    samples_ms: list[float] | None = dataclasses.field(
        default=None, metadata=OPTIONAL
    )  # raw samples: our kernel only
    ratio: float | None = dataclasses.field(
        default=None, metadata=OPTIONAL
    )  # baselines: their median / ours
    # how often its measurement was retaken for a spread that showed a disturbance
    retakes: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    status: str = "ok"

    def spread(self) -> float:
        return stats.spread(self.median_ms, self.iqr_ms)

    def is_unstable(self) -> bool:
        return stats.unstable(self.median_ms, self.iqr_ms)


@dataclasses.dataclass
class NotMeasured:
    """An implementation that refused the case ("unsupported") or failed on it ("error")."""

    status: str
    reason: str


@dataclasses.dataclass
class ReadFloor:
    median_ms: float
    gbps: float | None
    config: str
    ratio: float | None = dataclasses.field(default=None, metadata=OPTIONAL)  # its time / ours
    iqr_ms: float | None = dataclasses.field(default=None, metadata=OPTIONAL)  # older records: none
    retakes: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    status: str = "ok"

    def spread(self) -> float:
        return stats.spread(self.median_ms, self.iqr_ms or 0.0)  # older records: no IQR

    def is_unstable(self) -> bool:
        return self.iqr_ms is not None and stats.unstable(self.median_ms, self.iqr_ms)


Result = Measured | NotMeasured


@dataclasses.dataclass
class CaseRecord:
    """One case of the matrix: its fields (cases.Case), work, and every implementation's result."""

    id: str
    kind: str
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    group: str
    flops: int
    bytes: int
    ours: Result
    baselines: dict[str, Result]
    read_floor: ReadFloor | NotMeasured | None = dataclasses.field(default=None, metadata=OPTIONAL)
    layout: str | None = dataclasses.field(default=None, metadata=OPTIONAL)
    config: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    num_splits: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    cache_seqlens: list[int] | None = dataclasses.field(default=None, metadata=OPTIONAL)
    deterministic: bool | None = dataclasses.field(default=None, metadata=OPTIONAL)
    scores: str | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # v's and the output's head dim where it differs from head_dim (cases.Case.head_dim_v)
    head_dim_v: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # the interleaved measurement retaken this often for a disturbed spread (older records: none)
    retakes: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # the columns ("ours", baseline names) whose spread stayed over stats.UNSTABLE_SPREAD
    unstable: list[str] | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # backward cases: our kernel with deterministic=True, timed in the same rounds as ours; its
    # ratio is its time over ours (older records: none)
    ours_deterministic: Result | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # window_size (left, right), softcap and sinks (cases.Case), where the case has them
    window: list[int] | None = dataclasses.field(default=None, metadata=OPTIONAL)
    softcap: float | None = dataclasses.field(default=None, metadata=OPTIONAL)
    sinks: bool | None = dataclasses.field(default=None, metadata=OPTIONAL)

    @property
    def features(self) -> bool:
        """A window, softcap or sinks."""
        return bool(self.window or self.softcap or self.sinks)


@dataclasses.dataclass
class HostCost:
    """The per-call time of back-to-back calls (CUDA events around the whole loop)."""

    us_per_call: float  # the median of the loops
    calls: int  # calls per loop
    loops_us: list[float]  # each loop's time per call
    status: str = "ok"

    def spread(self) -> float:
        """The loops' IQR as a fraction of their median."""
        loops = stats.summarize(self.loops_us)
        return stats.spread(loops.median, loops.iqr)

    def is_unstable(self) -> bool:
        return self.spread() > stats.UNSTABLE_SPREAD


@dataclasses.dataclass
class ModelTiming:
    """The small model with one attention implementation."""

    prefill_ms: float  # one forward of the prompt batch (median)
    generate_ms: float  # greedy generation of new_tokens with the KV cache (median)
    decode_tokens_per_s: float  # tokens generated per second after the first (prefill left out)
    status: str = "ok"


@dataclasses.dataclass
class VarlenRecord:
    """A packed batch through flash_attention_varlen_forward (ours) against the same sequences
    through flash_attention_forward, one call per distinct length, in one timing window (dense)."""

    id: str
    kind: str  # "varlen"
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    causal: bool
    lengths: list[int]
    flops: int
    ours: Result
    dense: Result
    ratio: float | None  # dense time / ours: varlen's throughput over the dense kernel's
    # window_size (left, right) of both sides, where the target has one
    window: list[int] | None = dataclasses.field(default=None, metadata=OPTIONAL)


@dataclasses.dataclass
class PagedRecord:
    """Decode against a paged cache (ours) and against the same contents contiguous."""

    id: str
    kind: str  # "paged"
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    batch: int
    seqlen_k: int
    block_size: int
    kv_bytes: int
    ours: Result
    contiguous: Result
    read_floor: ReadFloor | NotMeasured | None
    ratio: float | None  # contiguous time / paged time: paged's speed over contiguous's
    floor_ratio: float | None  # read floor time / paged time
    contiguous_floor_ratio: float | None  # read floor time / contiguous time
    # each shuffled page order's median time (ms; None where not measured): ours is the median
    # order's record (older records: one order, no list)
    orders_ms: list[float | None] | None = dataclasses.field(default=None, metadata=OPTIONAL)


@dataclasses.dataclass
class HostRecord:
    """Per-call cost of back-to-back calls, ours beside SDPA's equivalent call."""

    id: str
    kind: str  # "host"
    call: str  # decode, decode-lens, paged64, varlen
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    batch: int
    seqlen_k: int
    calls: int
    ours: HostCost | NotMeasured
    sdpa: HostCost | NotMeasured
    ratio: float | None  # SDPA's time per call / ours


@dataclasses.dataclass
class ModelRecord:
    """The small Llama-style model, our attention against SDPA's, from one run."""

    id: str
    kind: str  # "model"
    dtype: str
    batch: int
    prompt: int
    new_tokens: int
    ours: ModelTiming | NotMeasured
    sdpa: ModelTiming | NotMeasured
    prefill_ratio: float | None  # SDPA's prefill time / ours
    decode_ratio: float | None  # our decode tokens/s / SDPA's


@dataclasses.dataclass
class StepRecord:
    """A training step (forward, backward, AdamW) of the small Llama-style model, our attention
    against SDPA's, from the same initialisation, both timed in the same interleaved rounds."""

    id: str
    kind: str  # "step"
    dtype: str
    layers: int
    heads_q: int
    heads_kv: int
    head_dim: int
    batch: int
    seqlen: int
    flops: int  # per step: 6 per parameter and token, plus the attention's forward and backward
    ours: Result
    sdpa: Result
    ours_tokens_per_s: float | None
    sdpa_tokens_per_s: float | None
    ratio: float | None  # our tokens/s over SDPA's (SDPA's time per step over ours)


@dataclasses.dataclass
class LossRun:
    """One model of a loss target trained: its loss at every step."""

    final_loss: float  # the last step's
    losses: list[float]
    seconds: float  # wall clock of the whole run
    status: str = "ok"


@dataclasses.dataclass
class LossRecord:
    """The Gemma-2-style model (sliding and global layers, a softcap) trained from one
    initialisation on the same batches with our attention (ours) and transformers' eager one."""

    id: str
    kind: str  # "loss"
    dtype: str  # the model's weights
    layers: int
    heads_q: int
    heads_kv: int
    head_dim: int
    batch: int
    seqlen: int
    window: int  # the sliding layers' sliding_window
    softcap: float  # attn_logit_softcapping
    steps: int
    ours: LossRun | NotMeasured
    eager: LossRun | NotMeasured
    ratio: float | None  # our final loss over eager's


TargetRecord = VarlenRecord | PagedRecord | HostRecord | ModelRecord | StepRecord | LossRecord


@dataclasses.dataclass
class CaseVerdict:
    """Head against base on one case (stats.Verdict, rounded)."""

    id: str
    verdict: str
    ratio: float
    change_pct: float
    p_value: float | None
    test: str
    base_median_ms: float
    base_iqr_ms: float
    n_base: int
    head_median_ms: float
    head_iqr_ms: float
    n_head: int

    @classmethod
    def of(cls, case_id: str, verdict: stats.Verdict) -> CaseVerdict:
        fields = {k: sig(v) if isinstance(v, float) else v for k, v in verdict.to_dict().items()}
        return cls(id=case_id, **fields)


@dataclasses.dataclass
class MissingVerdict:
    id: str
    reason: str
    verdict: str = "missing"


@dataclasses.dataclass
class BaseRef:
    ref: str
    sha: str | None
    stored_commit: str | None = dataclasses.field(default=None, metadata=OPTIONAL)
    stored_at: str | None = dataclasses.field(default=None, metadata=OPTIONAL)
    stored_torch: str | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # the base side's extra -D defines (bench --base-defines), when they differ from the head's
    defines: list[str] | None = dataclasses.field(default=None, metadata=OPTIONAL)


@dataclasses.dataclass
class Comparison:
    source: str  # "worktree", "stored" or "none"
    base: BaseRef
    reason: str | None
    threshold: float
    alpha: float
    rounds: int | None
    summary: dict[str, int]
    cases: list[CaseVerdict | MissingVerdict]

    def summary_text(self) -> str:
        s = self.summary
        return (
            f"{s['regression']} regression(s), {s['improvement']} improvement(s), "
            f"{s['no change']} no change, {s['missing']} missing"
        )


@dataclasses.dataclass(kw_only=True)
class BenchRecord:
    schema: str = SCHEMA
    provenance: dict
    timestamp: str
    backend: str
    gpu: Gpu | None
    driver: str | None
    torch: str
    cuda: str | None
    cudnn: int | None
    commit: Commit | None
    timing: TimingSetup
    ceilings: Ceilings
    cases: list[CaseRecord]
    comparison: Comparison | None = None
    # the speed-target cases (pipeline.bench.target_cases); left out when none ran
    targets: list[TargetRecord] | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # the extra -D defines of the library that was timed (FLASHMOE_BUILD_DEFINES); left out when
    # none: a run of a variant (an experiment's switch, a planted bug) says so
    defines: list[str] | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # the machine's load around the run (older records: none); a CPU run under load is not judged
    load: MachineLoad | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # the subset of the matrix timed (SUBSET_LABELS); left out for the whole matrix
    subset: str | None = dataclasses.field(default=None, metadata=OPTIONAL)
    # the geomean targets' groups (targets.MATRIX_GROUPS) of which the run timed some cases but
    # not all of the matrix's: their geomeans are shown, not judged; left out when none
    partial_groups: list[str] | None = dataclasses.field(default=None, metadata=OPTIONAL)


# --------------------------------------------------------------------------------------------------
# To and from JSON
# --------------------------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """Records to plain JSON values; optional fields that are None are left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_json(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.metadata.get("omit_if_none") and getattr(value, f.name) is None)
        }
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def _build(cls, data: dict):
    return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def result_from_json(data: dict) -> Result:
    return _build(Measured if data["status"] == "ok" else NotMeasured, data)


def case_from_json(data: dict) -> CaseRecord:
    record = _build(CaseRecord, data)
    record.ours = result_from_json(data["ours"])
    record.baselines = {name: result_from_json(r) for name, r in data["baselines"].items()}
    record.read_floor = _floor_from_json(data.get("read_floor"))
    if data.get("ours_deterministic") is not None:
        record.ours_deterministic = result_from_json(data["ours_deterministic"])
    return record


def _floor_from_json(floor: dict | None) -> ReadFloor | NotMeasured | None:
    if floor is None:
        return None
    return _build(ReadFloor if floor["status"] == "ok" else NotMeasured, floor)


TARGET_RECORDS = {
    "varlen": VarlenRecord,
    "paged": PagedRecord,
    "host": HostRecord,
    "model": ModelRecord,
    "step": StepRecord,
    "loss": LossRecord,
}
# What each target kind's two timed sides are made of, when measured
TARGET_RESULTS = {
    "varlen": (("ours", Measured), ("dense", Measured)),
    "paged": (("ours", Measured), ("contiguous", Measured)),
    "host": (("ours", HostCost), ("sdpa", HostCost)),
    "model": (("ours", ModelTiming), ("sdpa", ModelTiming)),
    "step": (("ours", Measured), ("sdpa", Measured)),
    "loss": (("ours", LossRun), ("eager", LossRun)),
}


def target_from_json(data: dict) -> TargetRecord:
    record = _build(TARGET_RECORDS[data["kind"]], data)
    for name, measured in TARGET_RESULTS[data["kind"]]:
        side = data[name]
        setattr(record, name, _build(measured if side["status"] == "ok" else NotMeasured, side))
    if data["kind"] == "paged":
        record.read_floor = _floor_from_json(data.get("read_floor"))
    return record


def comparison_from_json(data: dict) -> Comparison:
    record = _build(Comparison, data)
    record.base = _build(BaseRef, data["base"])
    record.cases = [
        _build(MissingVerdict if c["verdict"] == "missing" else CaseVerdict, c)
        for c in data["cases"]
    ]
    return record


def from_json(doc: dict) -> BenchRecord:
    """A BenchRecord from a document that already passed `validate`."""
    record = _build(BenchRecord, doc)
    record.gpu = _build(Gpu, doc["gpu"]) if doc["gpu"] is not None else None
    record.commit = _build(Commit, doc["commit"]) if doc["commit"] is not None else None
    record.timing = _build(TimingSetup, doc["timing"])
    record.ceilings = Ceilings.from_json(doc["ceilings"])
    record.cases = [case_from_json(c) for c in doc["cases"]]
    if doc["comparison"] is not None:
        record.comparison = comparison_from_json(doc["comparison"])
    if doc.get("targets") is not None:
        record.targets = [target_from_json(t) for t in doc["targets"]]
    if doc.get("load") is not None:
        record.load = _build(MachineLoad, doc["load"])
    return record


# --------------------------------------------------------------------------------------------------
# Validation, writing and reading
# --------------------------------------------------------------------------------------------------


def schema() -> dict:
    try:
        return json.loads(SCHEMA_PATH.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidBenchFile(
            f"cannot read the bench schema {SCHEMA_PATH}: {exc}; run from a checkout of the "
            "repository (benches/ holds it), or reinstall the package"
        ) from exc


VALIDATOR_MISSING = (
    "validating bench.json needs the jsonschema package: `pip install jsonschema` "
    "(or `pip install -e .`, which depends on it)"
)


def validator_problem() -> str | None:
    """Why bench.json could not be validated (and so not written) here, or None. The benchmark
    asks before it times anything: a missing package found at the end costs the whole run."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return VALIDATOR_MISSING
    return None


def schema_errors(doc: Any) -> list[str]:
    """Every way `doc` breaks benches/bench.schema.json, as 'path: message' lines."""
    if problem := validator_problem():
        raise InvalidBenchFile(problem)
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(map(str, e.absolute_path)) or '$'}: {e.message[:300]}" for e in errors]


def validate(doc: Any, what: str) -> None:
    errors = schema_errors(doc)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InvalidBenchFile(
            f"{what} does not follow {SCHEMA_PATH.name}: {errors[0]}{more}; "
            "rerun `python -m flashmoe_science bench` to write a fresh one"
        )


def write(record: BenchRecord, path: Path) -> None:
    """Validate, then write atomically (a reader never sees half a file)."""
    doc = to_json(record)
    validate(doc, f"the bench record for {path}")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def load(path: Path | str) -> BenchRecord:
    """Read and validate bench.json; InvalidBenchFile says what is wrong with a bad one."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise InvalidBenchFile(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise InvalidBenchFile(
            f"{path} is not JSON ({exc}); rerun `python -m flashmoe_science bench`"
        ) from exc
    validate(doc, str(path))
    return from_json(doc)
