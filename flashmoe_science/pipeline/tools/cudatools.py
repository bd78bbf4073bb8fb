"""What the pipeline's CUDA tools (compute-sanitizer, Nsight Compute) have in common: how they say
they cannot work here, how they name our kernels, and how their files are shown.

Finding a tool and running it live in flashmoe_science._toolkit (the build needs them too)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from ..build.compiler_output import shorten_kernel_name

# The tool cannot instrument the GPU here (old tool for the GPU, container without the debugger
# interface, a driver that forbids it): an environment problem, not a finding.
UNUSABLE_PATTERNS = (
    re.compile(r"Device not supported", re.IGNORECASE),
    re.compile(r"\berror 999\b|CUDA_ERROR_UNKNOWN|cudaErrorUnknown"),
    re.compile(r"insufficient permissions?", re.IGNORECASE),
    re.compile(r"Internal Sanitizer Error", re.IGNORECASE),
    re.compile(r"Unable to (?:find|load) (?:the )?injection library", re.IGNORECASE),
    re.compile(r"not supported on this (?:device|GPU|platform)", re.IGNORECASE),
)


def short_kernel(function: str) -> str:
    """'void flashmoe::cuda::flash_fwd_kernel<flashmoe::cuda::FwdTraits<(int)128, ...>, __half>(
    flashmoe::AttentionParams)' -> 'flash_fwd_kernel<FwdTraits<128, ...>, __half>'."""
    function = re.sub(r"\((?:int|unsigned int|long|bool|unsigned long)\)(?=-?\w)", "", function)
    return shorten_kernel_name(function, width=100)


def paths_display(path: Path) -> str:
    """A path relative to the current directory when under it (what a person typed), else as is."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def median_or_none(values: Sequence[float]) -> float | None:
    """A phase trace's median; None for a phase no block reached."""
    return statistics.median(values) if values else None


def trace_cell(value: float | None) -> str:
    """A traced time in microseconds for a table cell; '-' where nothing was measured."""
    return "-" if value is None else f"{value:.3f}"
