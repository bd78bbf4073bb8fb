"""Restricted builds (FLASHMOE_BUILD_ONLY, `build --only`; csrc/build_only.cuh): the loader spells a
restriction as -DFLASHMOE_ONLY_* defines and keys the build by them, the unit reads those defines
as the loader's Restriction does, and the CPU-only unit does not depend on them."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashmoe_science import _loader as loader
from flashmoe_science import _toolkit
from flashmoe_science.pipeline import exitcodes
from flashmoe_science.pipeline.build import unit as build
from flashmoe_science.pipeline.paths import REPO_ROOT

SM90A_PLANT = "op=fwd_sm90a,combine config=5,6,7"


@pytest.fixture
def cuda_machine(monkeypatch):
    """A torch with CUDA 13.0 and a matching nvcc, no GPU, no arch list and no restriction set."""
    monkeypatch.setattr(loader, "torch_versions", lambda: ("2.14.1+cu130", "13.0"))
    monkeypatch.setattr(
        loader, "find_cuda_toolkit", lambda: loader.CudaToolkit("/cuda/bin/nvcc", "/cuda", "13.0")
    )
    monkeypatch.setattr(loader, "visible_gpu_archs", list)
    for name in (
        "TORCH_CUDA_ARCH_LIST",
        "FLASHMOE_BUILD_ROOT",
        loader.ONLY_VAR,
        loader.DEFINES_VAR,
    ):
        monkeypatch.delenv(name, raising=False)


def test_only_becomes_the_defines_and_keys_the_build(cuda_machine, monkeypatch):
    full = build.resolve_config("cuda", arch_list="9.0a")
    config = build.resolve_config("cuda", arch_list="9.0a", only=SM90A_PLANT)
    assert config.defines == ("FLASHMOE_ONLY_OPS=fwd_sm90a+combine", "FLASHMOE_ONLY_CONFIGS=5+6+7")
    assert "-DFLASHMOE_ONLY_OPS=fwd_sm90a+combine" in loader.compile_flags(config)["cuda_cflags"]
    assert config.key.startswith(full.key + "-d") and full.defines == ()
    assert " with -DFLASHMOE_ONLY_OPS=fwd_sm90a+combine -DFLASHMOE_ONLY_CONFIGS=5+6+7 -> " in (
        build.describe(config)
    )
    # one restriction, one build: however it is spelt, and wherever it comes from
    for spelling in (
        "config=7,6,5 op=combine,fwd_sm90a head_dim=64,128,192,256",
        "op=fwd_sm90a op=combine config=5,6 config=7 dtype=fp16,bf16",
    ):
        assert build.resolve_config("cuda", arch_list="9.0a", only=spelling).key == config.key
    by_hand = build.resolve_config("cuda", arch_list="9.0a", defines=config.defines)
    assert by_hand.key == config.key
    monkeypatch.setenv(loader.ONLY_VAR, SM90A_PLANT)
    assert build.resolve_config("cuda", arch_list="9.0a").key == config.key
    assert build.resolve_config("cuda", arch_list="9.0a", only="").key == full.key
    # with a planted bug: both defines, one key of their own
    planted = build.resolve_config("cuda", arch_list="9.0a", defines=["FLASHMOE_PLANT_BUG=9"])
    assert planted.defines == ("FLASHMOE_PLANT_BUG=9", *config.defines)
    assert planted.key not in (config.key, full.key)


def test_build_only_is_the_build_commands_option(cuda_machine):
    args = build._parser().parse_args(
        ["--backend", "cuda", "--arch", "9.0a", "--only", "op=fwd,combine", "--only", "dtype=bf16"]
    )
    config = build.resolve_config(
        args.backend, args.arch, args.define, only=loader.only_arg(args.only)
    )
    assert config.defines == ("FLASHMOE_ONLY_OPS=fwd+combine", "FLASHMOE_ONLY_DTYPES=bf16")
    assert loader.only_arg(build._parser().parse_args([]).only) is None  # not given: the variable


def test_every_stage_builds_the_library_the_environments_defines_name(
    cuda_machine, monkeypatch, tmp_path
):
    """FLASHMOE_BUILD_DEFINES names the library every command of the process loads: the build
    command, the test stage's own build and the selection's key all take it (an experiment's
    switch or a stage under a define). The test stage once built the plain unit beside it, minutes
    of nvcc for a library no test loaded, and the selection keyed the plain build."""
    from flashmoe_science.pipeline.ci import selection
    from flashmoe_science.pipeline.gates import testing

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path))
    monkeypatch.setenv(loader.DEFINES_VAR, "FLASHMOE_BWD_WIDE_TMA=1")
    wanted = build.resolve_config("cuda", defines=["FLASHMOE_BWD_WIDE_TMA=1"])
    assert wanted.key != build.resolve_config("cuda", defines=()).key
    assert build.resolve_config("cuda").key == wanted.key
    built = []

    def no_compile(config, **kwargs):
        built.append(config)
        raise build.BuildError("not compiled here")

    monkeypatch.setattr(build, "build", no_compile)
    assert build.main(["--backend", "cuda"]) == exitcodes.BUILD_FAILED
    assert testing.main(["-k", "nothing"]) == exitcodes.BUILD_FAILED
    assert [config.key for config in built] == [wanted.key, wanted.key]
    assert selection.cuda_build() == (wanted.key, "13.0")


@pytest.mark.parametrize(
    "text, says",
    [
        ("op=fwdd", "bad FLASHMOE_BUILD_ONLY value op='fwdd': op is one of fwd, fwd_sm90a, "),
        ("head_dim=96", "bad FLASHMOE_BUILD_ONLY value head_dim='96': head_dim is one of 64, 128"),
        ("config=8", "config is one of 1, 2, 3, 4, 5, 6, 7"),
        ("backward_config=0", "backward_config is one of 1, 2, 3"),
        ("dtype=fp32", "bad FLASHMOE_BUILD_ONLY value dtype='fp32': dtype is one of fp16, bf16"),
        ("dtypes=bf16", "bad FLASHMOE_BUILD_ONLY item 'dtypes=bf16': write KEY=V1,V2 with KEY "),
        ("fwd", "bad FLASHMOE_BUILD_ONLY item 'fwd': write KEY=V1,V2 with KEY one of op, "),
        ("op=fwd config=5", "op=fwd with config=5 selects no kernel: fwd's are config 1, 2, 4"),
    ],
)
def test_a_bad_restriction_is_one_line_naming_it_and_what_is_supported(
    cuda_machine, monkeypatch, text, says
):
    monkeypatch.setenv(loader.ONLY_VAR, text)
    with pytest.raises(build.ConfigError) as excinfo:
        build.resolve_config("cuda", arch_list="9.0a")
    assert excinfo.value.exit_code == exitcodes.USAGE
    assert says in str(excinfo.value) and "\n" not in str(excinfo.value)
    with pytest.raises(build.ConfigError, match="--only"):
        build.resolve_config("cuda", arch_list="9.0a", only=text)


def test_a_restriction_by_hand_is_checked_and_not_given_twice(cuda_machine, monkeypatch):
    with pytest.raises(build.ConfigError, match="FLASHMOE_ONLY_OPS value op='fwd_sm90'"):
        build.resolve_config("cuda", arch_list="9.0a", defines=["FLASHMOE_ONLY_OPS=fwd_sm90"])
    monkeypatch.setenv(loader.ONLY_VAR, "op=fwd")
    with pytest.raises(build.ConfigError) as excinfo:
        build.resolve_config("cuda", arch_list="9.0a", defines=["FLASHMOE_ONLY_DTYPES=bf16"])
    assert str(excinfo.value) == (
        "the build restriction is given twice (-DFLASHMOE_ONLY_DTYPES=bf16 and 'op=fwd'): give it "
        "once, as FLASHMOE_BUILD_ONLY or --only"
    )


def test_the_cpu_unit_is_never_restricted(cuda_machine, monkeypatch):
    """The CPU-only unit has no kernels to leave out: a restriction in the environment (a GPU
    test's) leaves its build, and its key, the unrestricted one."""
    monkeypatch.setenv(loader.ONLY_VAR, SM90A_PLANT)
    for config in (
        build.resolve_config("cpu", defines=["FLASHMOE_PLANT_BUG=2"]),
        build.resolve_config("auto", defines=["FLASHMOE_PLANT_BUG=2"]),  # no GPU: the CPU unit
    ):
        assert config.backend == "cpu" and config.defines == ("FLASHMOE_PLANT_BUG=2",)
    assert build.resolve_config("cpu").key == "torch2.14.1-cpu"


def test_the_cpu_unit_reads_no_restriction_define():
    """csrc/flashmoe_science.cpp preprocesses to the same tokens with the restriction's defines as
    without them (only the CUDA unit's dispatch reads them)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    torch_include = loader.torch_package_dir() / "include"
    if compiler is None or not torch_include.is_dir():
        pytest.skip("needs a C++ compiler and torch's headers")
    config = build.resolve_config("cpu")
    flags = [f for f in loader.compile_flags(config)["cflags"] if f.startswith(("-D", "-f"))]
    includes = [str(torch_include), str(torch_include / "torch" / "csrc" / "api" / "include")]
    only = loader.Restriction.parse(
        "op=fwd,varlen head_dim=64 config=2 backward_config=1 dtype=bf16"
    )

    paths = [f"-I{REPO_ROOT / 'csrc'}", *(f"-isystem{i}" for i in includes)]

    def preprocessed(defines: tuple[str, ...]) -> str:
        done = subprocess.run(
            [
                compiler,
                "-std=c++17",
                "-E",
                "-P",
                *flags,
                *(f"-D{d}" for d in defines),
                *paths,
                str(REPO_ROOT / "csrc" / loader.CPU_SOURCE),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return " ".join(done.stdout.split())

    assert len(only.defines()) == 5
    assert preprocessed(()) == preprocessed(only.defines())


# ---- the unit's reading of the defines against the loader's ----------------------------------

STUB_OPS_HEADER = """\
#pragma once
#include <string>
#define TORCH_CHECK(cond, ...) ((void)0)
namespace flashmoe {
template <typename... Args>
std::string error_text(const Args&...) { return {}; }
}  // namespace flashmoe
"""


def _cuda_include() -> Path | None:
    nvcc, home = _toolkit.find_nvcc()
    home = home or (_toolkit.find_toolkit_home(nvcc, None, 60.0) if nvcc else None)
    include = Path(home) / "include" if home else None
    return include if include and (include / "cuda_fp16.h").is_file() else None


def _compile_built_checks(tmp_path: Path, defines: tuple[str, ...], checks: str):
    """Compiles `checks` (static_asserts over only::built) against csrc/build_only.cuh with these
    defines, its torch-dependent error path stubbed, for syntax only: a second, no GPU."""
    compiler, include = shutil.which("c++") or shutil.which("g++"), _cuda_include()
    if compiler is None or include is None:
        pytest.skip("needs a C++ compiler and the CUDA toolkit's headers")
    shutil.copy(REPO_ROOT / "csrc" / "build_only.cuh", tmp_path / "build_only.cuh")
    (tmp_path / "attention_ops.h").write_text(STUB_OPS_HEADER)
    (tmp_path / "checks.cpp").write_text(
        '#include "build_only.cuh"\nusing namespace flashmoe::cuda::only;\n' + checks
    )
    return subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-fsyntax-only",
            f"-isystem{include}",
            *(f"-D{d}" for d in defines),
            str(tmp_path / "checks.cpp"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "text",
    [
        SM90A_PLANT,
        "op=fwd,fwd_sm90a,decode,combine,bwd,bwd_sm90a dtype=bf16",
        "op=varlen,paged,bwd head_dim=128 config=1,3 backward_config=2 dtype=fp16",
        "head_dim=64 backward_config=3",
    ],
)
def test_the_unit_holds_what_the_loader_says_a_restriction_holds(tmp_path, text):
    """For every kernel family, dtype, head dim and tile configuration, csrc/build_only.cuh's
    `built` (what the unit instantiates) agrees with Restriction.holds (what the plant tests and
    the sanitizer's workload take the build to hold)."""
    restriction = loader.Restriction.parse(text)
    checks = []
    for op, dtype, head_dim in itertools.product(
        loader.ONLY_OPS, ("fp16", "bf16"), loader.CUDA_HEAD_DIMS
    ):
        option, configs = loader.ONLY_OPS[op]
        for config in configs or (0,):
            held = restriction.holds(op, dtype, head_dim, config)
            t = "__half" if dtype == "fp16" else "__nv_bfloat16"
            checks.append(
                f"static_assert(built<{t}>({op}, {head_dim}, {config}) == {str(held).lower()}, "
                f'"{op} {dtype} d{head_dim} {option}={config}");'
            )
    done = _compile_built_checks(tmp_path, restriction.defines(), "\n".join(checks))
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_unit_refuses_a_misspelt_restriction_define(tmp_path):
    done = _compile_built_checks(tmp_path, ("FLASHMOE_ONLY_OPS=fwd+fwd_sm90",), "")
    assert done.returncode != 0 and "FLASHMOE_ONLY_OPS: '+'-separated kernel families" in (
        done.stderr
    )
    assert _compile_built_checks(tmp_path, ("FLASHMOE_ONLY_OPS=fwd+fwd_sm90a",), "").returncode == 0


# ---- a restricted build on the GPU --------------------------------------------------------------

ON_GPU_ONLY = "op=fwd,combine head_dim=64 config=2 dtype=fp16"
ON_GPU_SCRIPT = """
import dataclasses, json, torch
from flashmoe_science import ops
from flashmoe_science.pipeline.gates import paged as paged_gates, varlen as varlen_gates

def attempt(call):
    try:
        call()
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

def qkv(dtype, head_dim, seqlen_q=129, grad=False):
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 4, seqlen_q, head_dim), (1, 4, 129, head_dim), (1, 4, 129, head_dim)]
    return [torch.randn(s, generator=g).to("cuda", dtype).requires_grad_(grad) for s in shapes]

q, k, v = qkv(torch.float16, 64)
out = ops.flash_attention_forward(q, k, v, True, num_splits=3, config=2)
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
varlen = dataclasses.replace(varlen_gates.varlen_cases("gpu")[0], config=2)
paged = paged_gates.paged_cases("gpu")[0]
print(json.dumps({
    "max_diff": float((out.float() - ref).abs().max()),
    "dtype": attempt(lambda: ops.flash_attention_forward(*qkv(torch.bfloat16, 64), config=2)),
    "head_dim": attempt(lambda: ops.flash_attention_forward(*qkv(torch.float16, 128), config=2)),
    "config": attempt(lambda: ops.flash_attention_forward(*qkv(torch.float16, 64), config=1)),
    "decode": attempt(lambda: ops.flash_attention_decode(*qkv(torch.float16, 64, 1), config=3)),
    "backward": attempt(lambda: ops.flash_attention_forward(
        *qkv(torch.float16, 64, grad=True), config=2).sum().backward()),
    "varlen": attempt(lambda: varlen_gates.call_varlen(
        varlen, *varlen_gates.make_varlen_inputs(varlen, "cuda", 0), 0.125)),
    "paged": attempt(lambda: paged_gates.call_paged(
        paged, *paged_gates.make_paged_inputs(paged, "cuda", 0), 0.125)),
}))
"""


@pytest.mark.gpu
@pytest.mark.slow
def test_a_restricted_build_holds_its_kernels_and_refuses_the_others(tmp_path):
    """Builds the unit restricted to one forward kernel and its combine (slow: even a unit of two
    kernels compiles torch's headers in both nvcc passes), checks the build holds exactly those
    kernels, that they run, and that every call needing another kernel (another dtype, head dim,
    configuration, the decode, backward, varlen and paged families) raises one line that names
    the restriction and says to rebuild without it, before anything is launched."""
    env = {**os.environ, loader.ONLY_VAR: ON_GPU_ONLY}
    env.pop("FLASHMOE_BUILD_DEFINES", None)
    built = subprocess.run(
        [sys.executable, "-m", "flashmoe_science", "build", "--backend", "cuda", "--quiet"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    record = json.loads((Path(os.environ["FLASHMOE_REPORTS_DIR"]) / build.REPORT_NAME).read_text())
    assert record["defines"] == list(loader.Restriction.parse(ON_GPU_ONLY).defines())
    assert {k["kernel"] for k in record["kernels"]} == {
        "flash_fwd_kernel<FwdTraits<64, 64, 64, 4, false>, __half>",
        "split_kv_combine_kernel<__half, 64>",
    }
    assert all(k["dynamic_smem"] is not None for k in record["kernels"])
    ran = subprocess.run(
        [sys.executable, "-c", ON_GPU_SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    results = json.loads(ran.stdout.strip().splitlines()[-1])
    assert results.pop("max_diff") < 1e-2
    defines = " ".join(f"-D{d}" for d in loader.Restriction.parse(ON_GPU_ONLY).defines())
    missing = {
        "dtype": "fwd kernel for bf16, head_dim 64, config 2",
        "head_dim": "fwd kernel for fp16, head_dim 128, config 2",
        "config": "fwd kernel for fp16, head_dim 64, config 1",
        "decode": "decode kernel for fp16, head_dim 64, config 3",
        "backward": "bwd",
        "varlen": "varlen kernel for fp16, head_dim 64, config 2",
        "paged": "paged kernel for fp16, head_dim 64, config 3",
    }
    for call, message in results.items():
        assert message.startswith("ValueError: this build holds only the kernels of " + defines)
        assert f"not the {missing[call]}" in message, (call, message)
        assert (
            message.endswith(
                "rebuild without the restriction (unset FLASHMOE_BUILD_ONLY, or "
                "build without --only)"
            )
            and "\n" not in message
        )


def test_the_restrictable_head_dims_are_those_the_cuda_operators_take():
    """`--only head_dim=` accepts the head dims the unit instantiates: the loader's list and the
    operators' (kCudaHeadDims, which their one-line refusal names) must move together when a head
    dim gains kernels."""
    import re

    source = (REPO_ROOT / "csrc" / "attention_ops.h").read_text()
    (listed,) = re.findall(r"constexpr int64_t kCudaHeadDims\[\] = \{([^}]*)\};", source)
    assert tuple(int(d) for d in listed.split(",")) == loader.CUDA_HEAD_DIMS
