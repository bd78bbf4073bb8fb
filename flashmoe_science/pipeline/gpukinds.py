"""The GPU kinds GPU CI runs on: one leg of gpu-ci.yml's `gpu` matrix per kind, each on runners
labelled `[self-hosted, linux, x64, gpu, KIND]`, each built for its own architecture, compared
with its own baseline (the head-vs-base bench on that runner, main's history of that kind) and
reported in its own section of the one PR comment.

    l4     NVIDIA L4 (Ada, sm_89): the mma.sync configurations
    h100   NVIDIA H100 (Hopper, sm_90a): the mma.sync configurations forced, and the sm_90a ones
    h200   NVIDIA H200 (Hopper, sm_90a): the same build and gates as h100, on the card clouds lend

The workflow's matrix, the gate, the history branch and the report all take the kinds from here
(tests/ci/test_workflows.py checks the matrix, its labels and its architectures against KINDS).
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class GpuKind:
    label: str  # the runner label and the matrix value
    arch: str  # TORCH_CUDA_ARCH_LIST of the leg's builds
    card: str  # what the label promises, for people
    name_pattern: str  # what torch's device name of such a card matches (case-insensitive)

    @property
    def sm(self) -> str:
        return "sm_" + self.arch.replace(".", "")

    @property
    def capability(self) -> str:
        """The compute capability of the card: '9.0' for sm_90a."""
        return self.arch.rstrip("af")

    def matches(self, device_name: str | None) -> bool:
        """Whether a device of this name is a card of this kind (a mislabelled runner is not)."""
        return bool(device_name) and re.search(self.name_pattern, device_name, re.I) is not None

    def device_problem(self, device_name: str, capability: str) -> str | None:
        """Why a device is not a card of this kind; None when it is."""
        if capability != self.capability:
            return f"{device_name} is sm_{capability.replace('.', '')}, not {self.sm}"
        if not self.matches(device_name):
            return f"{device_name} is not an {self.card}"
        return None


KINDS: dict[str, GpuKind] = {
    kind.label: kind
    for kind in (
        GpuKind("l4", "8.9", "NVIDIA L4", r"\bL4\b"),
        GpuKind("h100", "9.0a", "NVIDIA H100", r"\bH100\b"),
        GpuKind("h200", "9.0a", "NVIDIA H200", r"\bH200\b"),
    )
}
# The history branch kept one GPU's points at its top level before it kept one folder per kind;
# those points are this kind's (GPU CI ran only on L4 runners then).
LEGACY_KIND = "l4"
KIND_VAR = "FLASHMOE_GPU_KIND"  # set by a leg: its env stage checks the card is of that kind
ARTIFACT_PREFIX = "gpu-ci-reports-"  # a leg's artifact: ARTIFACT_PREFIX + kind
JOB_NAME = "GPU ({kind})"  # a leg's job name in gpu-ci.yml, as the jobs API lists it


def kind_of(label: str) -> GpuKind:
    """The kind of a runner label, or ValueError naming the labels there are."""
    try:
        return KINDS[label]
    except KeyError:
        raise ValueError(
            f"GPU kind {label!r} is not one of {', '.join(KINDS)} (pipeline.gpukinds.KINDS)"
        ) from None


def artifact_name(kind: str) -> str:
    return ARTIFACT_PREFIX + kind_of(kind).label


def job_name(kind: str) -> str:
    return JOB_NAME.format(kind=kind_of(kind).label)


def leg_run_id(run_id: str, kind: str) -> str:
    """The run id a leg's records carry (FLASHMOE_RUN_ID): the run's, then the kind, so that one
    leg's records never pass for another's."""
    return f"{run_id}-{kind_of(kind).label}"
