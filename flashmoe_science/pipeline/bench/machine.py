"""The machine a benchmark ran on: the GPU, its driver, the library versions, and the slug that
names its stored history. The commit comes from provenance.py."""

from __future__ import annotations

import contextlib
import platform
import re
import subprocess

import torch


def gpu_info(device: str) -> dict | None:
    if device != "cuda":
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
    }


def driver_version() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        return out.splitlines()[0].strip() if out else None
    return None


def machine_slug(gpu_name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'; CPU runs (None): 'cpu-x86_64'."""
    name = gpu_name or f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def versions(device: str) -> dict:
    """torch, the CUDA it was built with, and cuDNN (CUDA runs only)."""
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
    }
