"""`python -m flashmoe_science.pipeline.build.wheelcheck`: the package as a user gets it, tried as a user
would, on the CPU backend.

1. Build the sdist from a copy of the tree, then the wheel from that sdist (so both must carry the
   kernel sources); or take `--wheel PATH` (the release workflow's own wheel).
2. Check the wheel holds flashmoe_science/csrc/ with the units and their headers.
3. Make a fresh venv outside the checkout that sees this interpreter's torch and numpy through a
   .pth file (never downloading them), and install the wheel into it without dependencies.
4. In an empty temporary directory, with the build cache in a directory named by
   FLASHMOE_CACHE_DIR: prebuild with `python -m flashmoe_science build`, then call
   flash_attention_forward and flash_attention_decode against a reference and check that the calls
   did not build again.
5. Check that the current directory is still empty and the build landed in the cache.

Exit codes: 0 all held, 1 a check failed, 255 the machine cannot run the check (no torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from ... import _loader
from .. import exitcodes
from ..paths import REPO_ROOT

PACKAGED_SOURCES = (
    "flashmoe_science/csrc/flashmoe_science.cpp",
    "flashmoe_science/csrc/flashmoe_science.cu",
    "flashmoe_science/csrc/attention_ops.h",
    "flashmoe_science/csrc/flash_api_cuda.cuh",
)
TREE_FILES = ("pyproject.toml", "README.md", "MANIFEST.in", "flashmoe_science", "csrc", "benches")
STEP_TIMEOUT_S = 600

# Runs inside the fresh venv, in the empty directory: both public calls on the CPU, checked against
# plain softmax attention.
API_SNIPPET = """\
import json, math, sys
import torch
import flashmoe_science
from flashmoe_science import flash_attention_decode, flash_attention_forward

def reference(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ v

g = torch.Generator().manual_seed(0)
q = torch.randn(2, 4, 16, 64, generator=g).half()
k = torch.randn(2, 2, 40, 64, generator=g).half()
v = torch.randn(2, 2, 40, 64, generator=g).half()
out = flash_attention_forward(q, k, v, causal=True)
fwd_err = (out.float() - reference(q, k, v, True)).abs().max().item()
q1 = q[:, :, -1:]
dec = flash_attention_decode(q1, k, v)
dec_err = (dec.float() - reference(q1, k, v, True)).abs().max().item()
print(json.dumps({"package": flashmoe_science.__file__, "fwd_err": fwd_err, "decode_err": dec_err}))
"""
TOLERANCE = 2e-2


class CheckFailed(Exception):
    pass


def _say(text: str) -> None:
    print(f"wheelcheck: {text}", flush=True)


def _run(command: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run(
        list(command),
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        **kwargs,
    )
    if run.returncode != 0:
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-15:])
        raise CheckFailed(
            f"`{' '.join(map(str, command[:5]))} ...` exited {run.returncode}:\n{tail}"
        )
    return run


def _version_key(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def build_env() -> dict[str, str]:
    """The builds run without isolation (no network), so they use a setuptools this interpreter
    sees. A venv made by `python -m venv` on Python 3.11 carries setuptools 65, which cannot build
    a wheel by itself (bdist_wheel is built in from 70.1) and shadows the newer one a venv reuses
    through a .pth (as the act jobs' provisioning does): the newest setuptools in sight goes first."""
    import importlib.metadata as md

    env = dict(os.environ)
    found = list(md.distributions(name="setuptools"))
    if found:
        newest = max(found, key=lambda d: _version_key(d.version))
        location = str(newest.locate_file(""))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [location, env.get("PYTHONPATH")]))
    return env


def build_wheel(work: Path) -> Path:
    """sdist from a copy of the tree (nothing is written into the checkout), wheel from the sdist."""
    tree = work / "tree"
    tree.mkdir()
    for name in TREE_FILES:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, tree / name)
    dist = work / "dist"
    dist.mkdir()
    # no build isolation: setuptools comes from this environment, so the check needs no network
    _run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))",
            str(dist),
        ],
        cwd=tree,
        env=build_env(),
    )
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        # the "data" filter (no links out, no devices) exists from Python 3.10.12 and 3.11.4
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(work / "sdist", **safe)
    (unpacked,) = (work / "sdist").iterdir()
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    _run([*pip, "-w", str(dist), str(unpacked)], env=build_env())
    (wheel,) = dist.glob("*.whl")
    return wheel


def check_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in PACKAGED_SOURCES if name not in names]
    if missing:
        raise CheckFailed(f"{wheel.name} lacks the kernel sources: {', '.join(missing)}")


def make_venv(path: Path) -> Path:
    """A venv without pip that sees this interpreter's torch and the wheel's dependencies (a .pth
    file, not a copy), wherever each is installed: a GPU runner's tools can sit beside its torch or
    on PYTHONPATH (a machine without a package index, its wheels carried to /tmp/site)."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    python = path / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    shared = sorted(
        {str(Path(_package_dir(name)).parent) for name in ("torch", "numpy")}
        | {str(Path(found).parent) for found in map(_found_dir, SHARED_DEPENDENCIES) if found}
    )
    # Listed after the venv's own site-packages: the installed wheel wins over any other copy.
    (Path(purelib) / "flashmoe_shared_packages.pth").write_text("\n".join(shared) + "\n")
    return python


# The wheel's pure-Python runtime dependencies and theirs, by import name (pyproject's
# `dependencies`: jsonschema; ninja is a program, found on PATH by user_env).
SHARED_DEPENDENCIES = ("jsonschema", "jsonschema_specifications", "referencing", "rpds", "attrs")


def _found_dir(name: str) -> str | None:
    try:
        return _package_dir(name)
    except ModuleNotFoundError:
        return None


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(name)
    return next(iter(spec.submodule_search_locations))


def user_env(cache: Path) -> dict[str, str]:
    """The environment of a user outside the checkout: no PYTHONPATH, no pipeline or test-runner
    variables (a pytest-xdist worker's would make the bench refuse to time), the build cache where
    the check can look, and no GPU (the CPU backend)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "TORCH_CUDA_ARCH_LIST")
        and not k.startswith(("FLASHMOE_", "PYTEST_"))
    }
    env["FLASHMOE_CACHE_DIR"] = str(cache)
    env["CUDA_VISIBLE_DEVICES"] = ""
    # ninja (a dependency, not installed here with --no-deps) from this interpreter's environment
    scripts = sysconfig.get_paths()["scripts"]
    env["PATH"] = os.pathsep.join([env.get("PATH", ""), scripts, str(Path(sys.executable).parent)])
    return env


def check(wheel: Path | None, work: Path) -> dict:
    started = time.perf_counter()
    if wheel is None:
        _say("building the sdist and, from it, the wheel")
        wheel = build_wheel(work)
    check_contents(wheel)
    _say(f"{wheel.name} holds the kernel sources")
    python = make_venv(work / "venv")
    cwd, cache = work / "cwd", work / "cache"
    cwd.mkdir()
    env = user_env(cache)
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    _run([*pip, "--no-index", "--force-reinstall", str(wheel)], env=env)
    _say(f"installed into {work / 'venv'}; prebuilding into FLASHMOE_CACHE_DIR={cache}")
    _run([str(python), "-m", "flashmoe_science", "build", "--backend", "cpu"], cwd=cwd, env=env)
    run = _run([str(python), "-c", API_SNIPPET], cwd=cwd, env=env)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).resolve().is_relative_to((work / "venv").resolve()):
        raise CheckFailed(f"imported {result['package']}, not the installed wheel")
    if "building" in run.stderr:
        raise CheckFailed(f"the call built again after the prebuild:\n{run.stderr.strip()}")
    for key in ("fwd_err", "decode_err"):
        if not result[key] <= TOLERANCE:
            raise CheckFailed(f"{key} = {result[key]} exceeds {TOLERANCE}")
    left = sorted(p.name for p in cwd.iterdir())
    if left:
        raise CheckFailed(f"the calls wrote into the current directory: {', '.join(left)}")
    libraries = list(cache.glob(f"*/{_loader.LIBRARY_NAME}.so"))
    if not libraries:
        raise CheckFailed(f"no {_loader.LIBRARY_NAME}.so under FLASHMOE_CACHE_DIR={cache}")
    return {
        "wheel": wheel.name,
        "library": str(libraries[0].relative_to(cache)),
        "fwd_err": result["fwd_err"],
        "decode_err": result["decode_err"],
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe_science.pipeline.build.wheelcheck",
        description="Build the wheel, install it into a fresh venv outside the checkout and call "
        "both APIs on the CPU, writing nothing into the current directory.",
    )
    parser.add_argument("--wheel", type=Path, help="check this wheel instead of building one")
    args = parser.parse_args(argv)
    try:
        _package_dir("torch")
    except ModuleNotFoundError:
        _say("torch is not importable here; fix: run scripts/setup_environment.sh")
        return exitcodes.ENV_BROKEN
    with tempfile.TemporaryDirectory(prefix="flashmoe-wheelcheck-") as tmp:
        try:
            summary = check(args.wheel.resolve() if args.wheel else None, Path(tmp))
        except (CheckFailed, subprocess.TimeoutExpired) as exc:
            _say(f"FAILED: {exc}")
            return exitcodes.GATE_FAILED
    _say(
        f"ok in {summary['elapsed_s']} s: {summary['wheel']} works installed outside the checkout "
        f"(max error fwd {summary['fwd_err']:.1e}, decode {summary['decode_err']:.1e}); build in "
        f"the cache ({summary['library']}), nothing written to the current directory"
    )
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
