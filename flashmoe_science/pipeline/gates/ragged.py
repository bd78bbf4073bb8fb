"""What the varlen and paged gates share: their cases' normalisation and id fragments, a gate result
over the sequences of one call, its row in reports/gates.json, its failure report and rerun
commands, and the seed of a case.

A ragged call is judged per sequence: each sequence's rows go through gates.evaluate (both gates,
the log-sum-exp, determinism) against the reference of that sequence alone (RaggedResult.gate),
and any extra check (equality with our dense or contiguous path) adds its failures to that
sequence. The call passes when every sequence does; its row in gates.json is the worst sequence's
figures under the case id.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import dataclass

from ..cases import SCORES, SEED_VAR, normal_window
from .forward import GateResult, evaluate


class RaggedCaseParts:
    """For a frozen case dataclass with dtype, head_dim, head_dim_v, heads_q, heads_kv, causal,
    scores and window fields (PagedCase, VarlenCase): one spelling of a case (v's head dim kept
    only where it differs, the window normalised, the scores checked) and its id's fragments."""

    def normalise(self) -> None:
        if self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", 0)  # one case, one id
        object.__setattr__(self, "window", normal_window(self.window, self.causal))
        if self.scores not in SCORES:
            raise ValueError(
                f"{type(self).__name__} scores={self.scores!r} is not supported: use one of "
                f"{SCORES}"
            )

    def heads_part(self) -> str:
        return f"h{self.heads_q}" + (f"kv{self.heads_kv}" if self.heads_kv != self.heads_q else "")

    def dims_part(self) -> str:
        return f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v else "")


@dataclass(frozen=True)
class SequenceLabel:
    """What gates.evaluate reads of a case: an id (the call's, with the sequence) and a dtype."""

    id: str
    dtype: str


@dataclass
class RaggedResult:
    case_id: str
    sequences: list[GateResult] = dataclasses.field(default_factory=list)

    def gate(self, index: int, dtype: str, device: str, seed: int, *outputs) -> GateResult:
        """Gate sequence `index` of the call: `outputs` are gates.evaluate's (out, lse, out_again,
        lse_again, ref, ref_lse, out_pt) for that sequence alone. Returns its result, to which
        further checks add their failures."""
        result = evaluate(
            SequenceLabel(f"{self.case_id}/seq{index}", dtype), device, seed, *outputs
        )
        self.sequences.append(result)
        return result

    @property
    def failures(self) -> list[str]:
        return [f"{r.case_id}: {f}" for r in self.sequences for f in r.failures]

    @property
    def passed(self) -> bool:
        return not self.failures

    def worst(self) -> GateResult | None:
        if not self.sequences:
            return None
        return max(self.sequences, key=lambda r: (not r.passed, r.max_diff))

    def to_json(self) -> dict:
        worst = self.worst()
        row = worst.to_json() if worst else {"max_diff": 0.0, "ratio": 0.0}
        row["case_id"] = self.case_id
        row["failures"] = self.failures
        row["passed"] = self.passed
        row["sequences"] = len(self.sequences)
        return row

    def format_failure(self, case, device: str) -> str:
        """The multi-line report of a failing call of `case` (a varlen or paged gate case)."""
        lines = [f"FAILED {self.case_id}", f"  case: {case.describe()}"]
        for r in self.sequences:
            if r.passed:
                continue
            _batch, h, row, col = r.worst
            lines += [
                f"  {r.case_id} (seed {r.seed}): max diff {r.max_diff:.4g}, PyTorch's "
                f"{r.pt_max_diff:.4g}, gate-2 bound {r.bound:.4g}; worst element: head {h}, "
                f"query row {row}, column {col}",
                *(f"    {f}" for f in r.failures),
            ]
        lines.append(f"  rerun: {rerun_command(self.case_id, device)}")
        return "\n".join(lines)


def case_seed(case_id: str) -> int:
    """The case's own seed (FLASHMOE_SEED shifts every case's), as the dense gates draw theirs."""
    base = int(os.environ.get(SEED_VAR, "0"))
    return (zlib.crc32(case_id.encode()) + base) % (2**31)


def rerun_command(case_id: str, device: str) -> str:
    """The command that runs one ragged gate case alone (CUDA cases require the GPU)."""
    select = f"nox -s test -- --gates -k '{case_id}-{device}'"
    return f"FLASHMOE_REQUIRE_GPU=1 {select}" if device == "cuda" else select


def rerun_fields(case_id: str, device: str, config: int = 0) -> dict:
    """How to run one ragged gate case again (gates.rerun_fields' keys): the command, no CPU twin
    (the CPU tier has other lengths), and what a forced configuration needs beyond a GPU."""
    from ...ops import config_needs

    return {
        "rerun": rerun_command(case_id, device),
        "rerun_cpu": None,
        "rerun_needs": config_needs(config),
    }
