"""Tests of the build: the loader (flashmoe_science._loader), the compiler-output parsers on real
compiler output, and real tiny CPU builds through the pipeline's `build` (flashmoe_science.pipeline.build.unit).

The real compiles use a throwaway unit in tmp_path (not csrc/), a build root and a report folder in
tmp_path, and the CPU backend, so they run on any machine with a compiler and torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import pytest

from flashmoe_science import _loader as loader
from flashmoe_science import _toolkit
from flashmoe_science.pipeline import exitcodes
from flashmoe_science.pipeline.build import compiler_output
from flashmoe_science.pipeline.build import unit as build
from flashmoe_science.pipeline.paths import REPO_ROOT

# Real `-Xptxas=-v` output (CUDA 13.0) in the shape nvcc prints it, for two archs. The decode
# kernel spills on sm_89 only; softmax_rescale is a non-entry device function whose properties
# block must not be mistaken for a kernel's.
PTXAS_SAMPLE = """\
[1/2] /usr/local/cuda-13.0/bin/nvcc -MD -MF flashmoe_science.cuda.o.d -c /work/main/csrc/flashmoe_science.cu -o flashmoe_science.cuda.o
ptxas warning : Registers are spilled to local memory in function '_Z21flash_decode_split_kvILi128ELi4EEv19Flash_decode_params', 8 bytes spill stores, 12 bytes spill loads
ptxas info    : 28 bytes gmem
ptxas info    : Function properties for _ZN5flash15softmax_rescaleEPfi
    24 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_Z16flash_fwd_kernelILi128ELi64ELb1EEv16Flash_fwd_params' for 'sm_89'
ptxas info    : Function properties for _Z16flash_fwd_kernelILi128ELi64ELb1EEv16Flash_fwd_params
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 33280 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 48.361 ms
ptxas info    : Compiling entry function '_Z21flash_decode_split_kvILi128ELi4EEv19Flash_decode_params' for 'sm_89'
ptxas info    : Function properties for _Z21flash_decode_split_kvILi128ELi4EEv19Flash_decode_params
    272 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 272 bytes cumulative stack size, 16384 bytes smem, 372 bytes cmem[0]
ptxas info    : Compile time = 50.101 ms
ptxas info    : Compiling entry function '_ZN12_GLOBAL__N_111combine_lseEPKfPfi' for 'sm_89'
ptxas info    : Function properties for _ZN12_GLOBAL__N_111combine_lseEPKfPfi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
ptxas info    : 28 bytes gmem
ptxas info    : Compiling entry function '_Z16flash_fwd_kernelILi128ELi64ELb1EEv16Flash_fwd_params' for 'sm_90'
ptxas info    : Function properties for _Z16flash_fwd_kernelILi128ELi64ELb1EEv16Flash_fwd_params
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 49152 bytes smem
ptxas info    : Compiling entry function '_Z21flash_decode_split_kvILi128ELi4EEv19Flash_decode_params' for 'sm_90'
ptxas info    : Function properties for _Z21flash_decode_split_kvILi128ELi4EEv19Flash_decode_params
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 16384 bytes smem
ptxas info    : Compiling entry function '_ZN12_GLOBAL__N_111combine_lseEPKfPfi' for 'sm_90'
ptxas info    : Function properties for _ZN12_GLOBAL__N_111combine_lseEPKfPfi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
[2/2] c++ flashmoe_science.cuda.o -shared -fopenmp -L/x/torch/lib -lc10 -lc10_cuda -o flashmoe_science_C.so
"""

# What build.log holds after nvcc fails (CUDA 13.0, torch 2.14.1); command lines shortened.
NVCC_FAILURE_LOG = """\
$ /work/main/.venv/bin/python -m flashmoe_science.pipeline.build.unit --child /work/main/build/torch2.14.1-cu13.0-sm90/child.json
W1126 02:05:55.282000 6599 torch/utils/cpp_extension.py:183] No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda-13.0'
[1/2] /usr/local/cuda-13.0/bin/nvcc -MD -MF flashmoe_science.cuda.o.d -DTORCH_EXTENSION_NAME=flashmoe_science_C -c /work/main/csrc/flashmoe_science.cu -o flashmoe_science.cuda.o
FAILED: [code=255] flashmoe_science.cuda.o
/usr/local/cuda-13.0/bin/nvcc -MD -MF flashmoe_science.cuda.o.d -DTORCH_EXTENSION_NAME=flashmoe_science_C -c /work/main/csrc/flashmoe_science.cu -o flashmoe_science.cuda.o
/work/main/csrc/flash_fwd.cuh(212): error: identifier "row_max" is undefined
        scores[i] = expf(scores[i] - row_max);
                                     ^
          detected during instantiation of "void flash_fwd_kernel<kHeadDim,kBlockN,kCausal>(Flash_fwd_params) [with kHeadDim=128, kBlockN=64, kCausal=true]" at line 40 of /work/main/csrc/flashmoe_science.cu

/work/main/csrc/flash_fwd.cuh(230): error: no suitable conversion function from "__half" to "float *" exists
          acc_o = tile;
                  ^

2 errors detected in the compilation of "/work/main/csrc/flashmoe_science.cu".
ninja: build stopped: subcommand failed.
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/torch/utils/cpp_extension.py", line 2906, in _run_ninja_build
    subprocess.run(
subprocess.CalledProcessError: Command '['ninja', '-v']' returned non-zero exit status 255.
RuntimeError: Error building extension 'flashmoe_science_C'
FLASHMOE_BUILD_CHILD: error: RuntimeError: Error building extension 'flashmoe_science_C'
"""

GCC_FAILURE_LOG = """\
[1/2] c++ -MMD -MF flashmoe_science.o.d -DTORCH_EXTENSION_NAME=flashmoe_science_C -c /work/main/csrc/flashmoe_science.cpp -o flashmoe_science.o
FAILED: [code=1] flashmoe_science.o
c++ -MMD -MF flashmoe_science.o.d -DTORCH_EXTENSION_NAME=flashmoe_science_C -c /work/main/csrc/flashmoe_science.cpp -o flashmoe_science.o
In file included from /work/main/csrc/flashmoe_science.cpp:3:
/work/main/csrc/attention_cpu.h: In function 'at::Tensor attention_cpu(const at::Tensor&)':
/work/main/csrc/attention_cpu.h:17:15: error: expected ';' before '}' token
   17 |   return out
      |             ^
      |             ;
   18 | }
      | ~
/work/main/csrc/flashmoe_science.cpp:9:11: error: expected ')' at end of input
    9 | int g( { }
      |      ~    ^
ninja: build stopped: subcommand failed.
FLASHMOE_BUILD_CHILD: error: RuntimeError: Error building extension 'flashmoe_science_C'
"""

LINK_FAILURE_LOG = """\
[2/2] c++ flashmoe_science.cuda.o -shared -fopenmp -L/x/torch/lib -lc10 -o flashmoe_science_C.so
FAILED: [code=1] flashmoe_science_C.so
/usr/bin/ld: flashmoe_science.cuda.o: in function `launch_decode(Flash_decode_params&)':
flashmoe_science.cu:(.text+0x11): undefined reference to `split_kv_combine(float const*, float*, int)'
collect2: error: ld returned 1 exit status
ninja: build stopped: subcommand failed.
"""

PTXAS_FAILURE_LOG = """\
FAILED: [code=255] flashmoe_science.cuda.o
ptxas error   : Entry function '_Z3bigPf' uses too much shared data (0x3a980 bytes, 0xc000 max)
ptxas info    : 0 bytes gmem
ninja: build stopped: subcommand failed.
"""

LOAD_FAILURE_LOG = """\
[2/2] c++ flashmoe_science.cuda.o -shared -o flashmoe_science_C.so
Traceback (most recent call last):
OSError: /work/main/build/x/flashmoe_science_C.so: undefined symbol: _Z16split_kv_combinePKfPfi
FLASHMOE_BUILD_CHILD: error: OSError: /work/main/build/x/flashmoe_science_C.so: undefined symbol: _Z16split_kv_combinePKfPfi
"""

# The logs were recorded in a checkout at /work/main; move them into this checkout, wherever it is
# (CI clones elsewhere), since the condensed errors show paths relative to the repository.
NVCC_FAILURE_LOG, GCC_FAILURE_LOG, LINK_FAILURE_LOG, PTXAS_FAILURE_LOG, LOAD_FAILURE_LOG = (
    log.replace("/work/main", str(REPO_ROOT))
    for log in (
        NVCC_FAILURE_LOG,
        GCC_FAILURE_LOG,
        LINK_FAILURE_LOG,
        PTXAS_FAILURE_LOG,
        LOAD_FAILURE_LOG,
    )
)

# Without torch's headers (they cost ~6 CPU-s a compile on 2 cores): what the build tests check is
# the build's output, its record and when it compiles again. A clean checkout's stage compiles two
# units with them anyway (its own build, which its gates load, and the plant build).
TINY_UNIT = """\
#include "twice.h"
extern "C" int twice(int x) { return x * kFactor; }
"""

# No torch headers: the compiler reaches the error in a fraction of a second.
BROKEN_UNIT = """\
#include "twice.h"
int twice(int x) {
  return x * kFactor
}
"""


def identity(names: list[str]) -> list[str]:
    return list(names)


# --------------------------------------------------------------------------------------------------
# ptxas resource report
# --------------------------------------------------------------------------------------------------


def test_parse_ptxas_reads_every_entry_and_arch():
    kernels = compiler_output.parse_ptxas(PTXAS_SAMPLE, demangle=identity)
    assert [(k["mangled"], k["arch"]) for k in kernels] == [
        ("_Z16flash_fwd_kernelILi128ELi64ELb1EEv16Flash_fwd_params", "sm_89"),
        ("_Z21flash_decode_split_kvILi128ELi4EEv19Flash_decode_params", "sm_89"),
        ("_ZN12_GLOBAL__N_111combine_lseEPKfPfi", "sm_89"),
        ("_Z16flash_fwd_kernelILi128ELi64ELb1EEv16Flash_fwd_params", "sm_90"),
        ("_Z21flash_decode_split_kvILi128ELi4EEv19Flash_decode_params", "sm_90"),
        ("_ZN12_GLOBAL__N_111combine_lseEPKfPfi", "sm_90"),
    ]
    fwd89, decode89, combine89, fwd90, decode90, combine90 = kernels
    assert (fwd89["registers"], fwd89["smem_bytes"], fwd89["stack_bytes"]) == (128, 33280, 0)
    assert (fwd90["registers"], fwd90["smem_bytes"]) == (168, 49152)
    assert (decode89["registers"], decode89["stack_bytes"]) == (255, 272)
    assert (decode89["spill_stores"], decode89["spill_loads"]) == (8, 12)
    assert (decode90["spill_stores"], decode90["spill_loads"]) == (0, 0)
    assert combine89["smem_bytes"] == 0 and combine90["registers"] == 8
    # the device function's 24-byte stack frame belongs to no kernel
    assert all(k["stack_bytes"] in (0, 272) for k in kernels)
    assert compiler_output.spilling(kernels) == [decode89]


@pytest.mark.skipif(not shutil.which("c++filt"), reason="no c++filt (binutils)")
def test_parse_ptxas_demangles_and_shortens_names():
    names = [k["kernel"] for k in compiler_output.parse_ptxas(PTXAS_SAMPLE)[:3]]
    assert names == [
        "flash_fwd_kernel<128, 64, true>",
        "flash_decode_split_kv<128, 4>",
        "combine_lse",
    ]


def test_shorten_kernel_name():
    assert (
        compiler_output.shorten_kernel_name(
            "void flash::fwd<Traits<128, 64>, true>(Params, int (*)(int))"
        )
        == "fwd<Traits<128, 64>, true>"
    )
    long_name = "void k<" + ", ".join(["cutlass::half_t"] * 10) + ">(P)"
    short = compiler_output.shorten_kernel_name(long_name, width=40)
    assert len(short) == 40 and "..." in short
    # instantiations that differ only past the cut (the dtype, last) stay apart
    other = compiler_output.shorten_kernel_name(long_name.replace("half_t>", "bfloat16_t>"), 40)
    assert len(other) == 40 and other != short and other[:29] == short[:29]


def test_resource_table_is_aligned():
    rows = build.format_resource_table(compiler_output.parse_ptxas(PTXAS_SAMPLE, demangle=identity))
    assert len(rows) == 7 and len({len(row) for row in rows}) == 1
    assert "8/12" in rows[2]


# --------------------------------------------------------------------------------------------------
# First error
# --------------------------------------------------------------------------------------------------


def test_first_error_of_nvcc():
    first = compiler_output.extract_first_error(NVCC_FAILURE_LOG)
    assert first.kind == "compile"
    assert first.location == "csrc/flash_fwd.cuh:212"
    assert first.lines[0].endswith('error: identifier "row_max" is undefined')
    assert "expf(scores[i] - row_max)" in first.lines[1] and first.lines[2].strip() == "^"
    assert "detected during instantiation" in first.lines[3]
    assert first.more == 1


def test_condensed_nvcc_error_is_short_and_says_what_next():
    message = compiler_output.condense_failure(NVCC_FAILURE_LOG, REPO_ROOT / "build/k/build.log")
    lines = message.splitlines()
    assert len(lines) <= 8
    assert lines[0].startswith('csrc/flash_fwd.cuh(212): error: identifier "row_max"')
    assert "(+1 more error in the log)" in lines
    assert lines[-1].startswith("next: fix csrc/flash_fwd.cuh:212")
    assert lines[-1].endswith("full log: build/k/build.log")
    assert "Traceback" not in message and "ninja" not in message


def test_first_error_of_gcc():
    first = compiler_output.extract_first_error(GCC_FAILURE_LOG)
    assert first.kind == "compile"
    assert first.location == "csrc/attention_cpu.h:17"
    assert first.lines[1].strip().startswith("17 |   return out")
    assert len(first.lines) == 4 and first.more == 1


@pytest.mark.parametrize(
    ("log", "kind", "needle", "hint"),
    [
        (LINK_FAILURE_LOG, "link", "undefined reference to `split_kv_combine", "at link time"),
        (PTXAS_FAILURE_LOG, "ptxas", "uses too much shared data", "hardware limit"),
        (LOAD_FAILURE_LOG, "load", "undefined symbol", "does not load"),
    ],
)
def test_first_error_of_linker_ptxas_and_loader(log, kind, needle, hint):
    first = compiler_output.extract_first_error(log)
    assert first.kind == kind and first.location is None
    assert any(needle in line for line in first.lines)
    message = compiler_output.condense_failure(log, Path("/tmp/build.log")).splitlines()
    assert len(message) <= 8 and hint in message[-1]


def test_child_without_torch_is_an_environment_failure():
    log = "FLASHMOE_BUILD_CHILD: error: torch import failed: ImportError: libtorch_cpu.so: cannot open\n"
    assert compiler_output.extract_first_error(log).kind == "environment"
    assert compiler_output.failure_exit_code(log) == exitcodes.ENV_BROKEN
    assert "pip install ninja" in compiler_output.condense_failure(log, Path("/tmp/build.log"))


def test_failure_without_a_compiler_error_suggests_fewer_jobs():
    message = compiler_output.condense_failure(
        "[1/2] nvcc -c a.cu -o a.o\n", Path("/tmp/build.log"), returncode=-9
    )
    assert "killed by signal 9" in message and "MAX_JOBS=1" in message.splitlines()[-1]


# --------------------------------------------------------------------------------------------------
# Configuration and keys
# --------------------------------------------------------------------------------------------------


def test_key_encodes_torch_cuda_archs_and_defines():
    base = loader.build_key("2.14.1+cu130", "13.0", ("8.9", "9.0"))
    assert base == "torch2.14.1-cu13.0-sm89_sm90"
    assert loader.build_key("2.14.1+cu130", None, ()) == "torch2.14.1-cpu"
    others = {
        loader.build_key("2.15.0+cu130", "13.0", ("8.9", "9.0")),
        loader.build_key("2.14.1+cu130", "13.0", ("9.0",)),
        loader.build_key("2.14.1+cu130", "13.0", ("9.0a",)),
        loader.build_key("2.14.1+cu130", "13.0", ("8.9", "9.0"), ("FLASHMOE_PLANT_BUG=2",)),
        loader.build_key("2.14.1+cu130", "13.0", ("8.9", "9.0"), ("FLASHMOE_PLANT_BUG=3",)),
    }
    assert len(others) == 5 and base not in others
    assert loader.build_key(
        "2.14.1+cu130", "13.0", ("8.9", "9.0"), ("FLASHMOE_PLANT_BUG=2",)
    ).startswith(base + "-d")


def test_parse_arch_list_normalizes_and_rejects_nonsense():
    assert loader.parse_arch_list("9.0;8.9") == ("8.9", "9.0")
    assert loader.parse_arch_list("sm_90a, 89 9.0+PTX 9.0") == ("8.9", "9.0", "9.0+PTX", "9.0a")
    assert [loader.arch_label(a) for a in ("9.0a", "10.0")] == ["sm_90a", "sm_100"]
    with pytest.raises(build.ConfigError) as excinfo:
        loader.parse_arch_list("hopper")
    assert excinfo.value.exit_code == exitcodes.USAGE


@pytest.fixture
def cuda_machine(monkeypatch):
    """A torch with CUDA 13.0 and a matching nvcc, with no GPU and no TORCH_CUDA_ARCH_LIST."""
    monkeypatch.setattr(loader, "torch_versions", lambda: ("2.14.1+cu130", "13.0"))
    monkeypatch.setattr(
        loader, "find_cuda_toolkit", lambda: loader.CudaToolkit("/cuda/bin/nvcc", "/cuda", "13.0")
    )
    monkeypatch.setattr(loader, "visible_gpu_archs", list)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("FLASHMOE_BUILD_ROOT", raising=False)  # describe() shows the default build/


def test_auto_without_gpu_or_arch_list_builds_cpu_and_says_why(cuda_machine):
    config = build.resolve_config("auto")
    assert config.backend == "cpu" and config.source.name == "flashmoe_science.cpp"
    assert (
        config.reason == "no GPU visible and TORCH_CUDA_ARCH_LIST unset: building the CPU-only unit"
    )
    assert config.key == "torch2.14.1-cpu"


def test_auto_with_arch_list_builds_cuda(cuda_machine, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0;8.9")
    config = build.resolve_config("auto", defines=["-DFLASHMOE_PLANT_BUG=2"])
    assert config.backend == "cuda" and config.source.name == "flashmoe_science.cu"
    assert config.arch_list == ("8.9", "9.0") and config.defines == ("FLASHMOE_PLANT_BUG=2",)
    flags = loader.compile_flags(config)
    assert (
        "-DFLASHMOE_WITH_CUDA" in flags["cuda_cflags"]
        and "-DFLASHMOE_PLANT_BUG=2" in flags["cuda_cflags"]
    )
    assert "-Xptxas=--warn-on-spills" in flags["cuda_cflags"]
    assert build.describe(config).startswith(
        "build: CUDA unit csrc/flashmoe_science.cu for sm_89, sm_90 (torch 2.14.1, CUDA 13.0) with "
        "-DFLASHMOE_PLANT_BUG=2 -> build/torch2.14.1-cu13.0-sm89_sm90-d"
    )


def test_the_plant_build_is_one_build_for_each_device(cuda_machine, monkeypatch):
    """Every plant in one build, picked at run time: its CUDA kernels carry every CUDA plant
    (csrc/flash_kernel_utils.cuh, planted), so the build resolves for CUDA and for the CPU alike."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    config = build.resolve_config("auto", defines=[loader.PLANT_DEFINE])
    assert config.backend == "cuda" and config.defines[0] == "FLASHMOE_PLANT_BUG=-1"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    config = build.resolve_config("cpu", defines=[loader.PLANT_DEFINE])
    assert config.backend == "cpu" and config.defines == ("FLASHMOE_PLANT_BUG=-1",)


def test_visible_gpu_gives_the_targets(cuda_machine, monkeypatch):
    monkeypatch.setattr(loader, "visible_gpu_archs", lambda: ["8.9"])
    config = build.resolve_config("auto")
    assert config.backend == "cuda" and config.arch_list == ("8.9",) and "sm_89" in config.reason
    assert "-DFLASHMOE_SM90A" not in loader.compile_flags(config)["cuda_cflags"]


def test_a_visible_90_gpu_is_built_sm90a_with_its_define(cuda_machine, monkeypatch):
    """The wgmma kernels need sm_90a; a build for the visible H100 targets it, and both the host
    and the device passes are told (FLASHMOE_SM90A), which also keys the build and its hash."""
    monkeypatch.setattr(loader, "visible_gpu_archs", lambda: ["8.9", "9.0"])
    config = build.resolve_config("auto")
    assert config.arch_list == ("8.9", "9.0a") and config.reason == "visible GPU: sm_89, sm_90"
    assert config.key == "torch2.14.1-cu13.0-sm89_sm90a" and config.defines == ()
    flags = loader.compile_flags(config)
    assert "-DFLASHMOE_SM90A" in flags["cflags"] and "-DFLASHMOE_SM90A" in flags["cuda_cflags"]
    assert build.describe(config).startswith(
        "build: CUDA unit csrc/flashmoe_science.cu for sm_89, sm_90a "
    )
    # the same targets asked for by name build the same thing; plain 9.0 stays plain sm_90
    for named in (
        build.resolve_config("auto", arch_list="8.9;9.0a"),
        build.resolve_config("auto", arch_list="sm_90a+PTX 89"),
    ):
        assert loader.targets_sm90a(named.arch_list)
        assert "-DFLASHMOE_SM90A" in loader.compile_flags(named)["cuda_cflags"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.9;9.0a")
    assert build.resolve_config("auto").key == config.key
    plain = build.resolve_config("auto", arch_list="9.0")
    assert plain.arch_list == ("9.0",) and plain.key == "torch2.14.1-cu13.0-sm90"
    assert not any(
        "SM90A" in f
        for f in [
            *loader.compile_flags(plain)["cflags"],
            *loader.compile_flags(plain)["cuda_cflags"],
        ]
    )
    assert loader.source_hash(plain) != loader.source_hash(
        build.resolve_config("auto", arch_list="9.0a")
    )


def test_a_build_is_recognised_wherever_the_checkout_and_torch_lie(
    cuda_machine, monkeypatch, tmp_path
):
    """The build hash holds no absolute path: a copy of the sources in another place, under a torch
    installed elsewhere (its pip nvidia headers in the include paths, their libraries in the
    linker's -L folders), hashes the same, so a build
    made on one machine (or in a runner's cache) is reused on another with the same torch and
    toolkit release; an edit to a source still changes it."""
    sites = []
    for where in ("here", "there"):
        site = tmp_path / where / "lib" / "site-packages"
        (site / "torch").mkdir(parents=True)
        (site / "nvidia" / "cublas" / "include").mkdir(parents=True)
        (site / "nvidia" / "cublas" / "lib").mkdir(parents=True)
        sources = tmp_path / where / "checkout" / "csrc"
        shutil.copytree(REPO_ROOT / "csrc", sources)
        sites.append((site, sources))

    def hash_at(site, sources):  # the hash as a machine with torch under `site` computes it
        monkeypatch.setattr(loader, "torch_package_dir", lambda: site / "torch")
        config = dataclasses.replace(
            build.resolve_config("cuda", arch_list="9.0a"), sources_dir=sources
        )
        flags = loader.compile_flags(config)
        assert str(sources) in flags["include_paths"]
        assert str(site / "nvidia" / "cublas" / "include") in flags["include_paths"]
        assert f"-L{site / 'nvidia' / 'cublas' / 'lib'}" in flags["ldflags"]
        return loader.source_hash(config)

    assert hash_at(*sites[0]) == hash_at(*sites[1])
    (sites[1][1] / "attention_params.h").write_text("// edited\n", encoding="utf-8")
    assert hash_at(*sites[0]) != hash_at(*sites[1])


def test_torch_turns_the_targets_into_sm90a_gencode(cuda_machine, monkeypatch, tmp_path):
    """The child hands the targets to torch's cpp_extension as TORCH_CUDA_ARCH_LIST: 9.0a must come
    out as real sm_90a code (and no flag of ours may contain 'arch', or torch adds none at all)."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    monkeypatch.setenv("FLASHMOE_BUILD_ROOT", str(tmp_path))  # the child's spec is written there
    config = build.resolve_config("cuda", arch_list="8.9;9.0a")
    config.build_dir.mkdir(parents=True)
    _command, env = loader._child_command(config)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env["TORCH_CUDA_ARCH_LIST"])
    flags = loader.compile_flags(config)["cuda_cflags"]
    assert sorted(cpp_extension._get_cuda_arch_flags(flags)) == [
        "-gencode=arch=compute_89,code=sm_89",
        "-gencode=arch=compute_90a,code=sm_90a",
    ]


def test_the_sm90a_define_comes_with_the_target_only(cuda_machine):
    with pytest.raises(build.ConfigError) as excinfo:
        build.resolve_config("auto", arch_list="9.0", defines=["-DFLASHMOE_SM90A"])
    assert excinfo.value.exit_code == exitcodes.USAGE
    assert str(excinfo.value) == (
        "-DFLASHMOE_SM90A without the sm_90a target (--arch 9.0): build with --arch 9.0a "
        "(the define then comes by itself)"
    )
    by_hand = build.resolve_config("auto", arch_list="9.0a", defines=["FLASHMOE_SM90A"])
    assert by_hand.key == build.resolve_config("auto", arch_list="9.0a").key


def test_the_loaded_library_names_its_targets(tmp_path):
    library = tmp_path / "flashmoe_science_C.so"
    assert loader.library_arch_list(library) == ()
    (tmp_path / "build.json").write_text(json.dumps({"arch_list": ["8.9", "9.0a"]}))
    assert loader.library_arch_list(library) == ("8.9", "9.0a")
    (tmp_path / "build.json").write_text(json.dumps({"arch_list": []}))
    assert loader.library_arch_list(library) == ()
    (tmp_path / "build.json").write_text("[1, 2]")
    assert loader.library_arch_list(library) == ()


def test_nox_compile_builds_every_gpu_kind():
    """`nox -s compile` (CPU CI's CUDA check) compiles what each GPU CI leg builds: sm_89 and
    sm_90a, the wgmma kernels included."""
    from flashmoe_science.pipeline import gpukinds

    noxfile = (REPO_ROOT / "noxfile.py").read_text()
    session = noxfile[noxfile.index("def compile(") :].split("\n\n\n")[0]
    (archs,) = re.findall(r'"--arch", "([^"]+)"', session)
    assert loader.parse_arch_list(archs) == tuple(
        dict.fromkeys(k.arch for k in gpukinds.KINDS.values())
    )
    assert loader.parse_arch_list(archs) == ("8.9", "9.0a")


def test_nvcc_major_mismatch_falls_back_to_cpu(cuda_machine, monkeypatch):
    monkeypatch.setattr(
        loader, "find_cuda_toolkit", lambda: loader.CudaToolkit("/c/bin/nvcc", "/c", "12.4")
    )
    config = build.resolve_config("auto", arch_list="9.0")
    assert config.backend == "cpu" and "nvcc 12.4" in config.reason and "13.0" in config.reason


@pytest.mark.parametrize(
    "argv", [["--arch", "8.9", "--arch", "9.0a"], ["--arch", "8.9;9.0a"], ["--arch=9.0a,8.9"]]
)
def test_arch_given_twice_or_as_a_list_builds_every_target(cuda_machine, argv):
    args = build._parser().parse_args(["--backend", "cuda", *argv])
    config = build.resolve_config(args.backend, args.arch)
    assert config.arch_list == ("8.9", "9.0a")


def test_backend_cuda_when_impossible_explains_what_is_missing(cuda_machine, monkeypatch):
    with pytest.raises(build.ConfigError) as excinfo:
        build.resolve_config("cuda")
    assert excinfo.value.exit_code == exitcodes.ENV_BROKEN and "--arch" in str(excinfo.value)
    monkeypatch.setattr(
        loader, "find_cuda_toolkit", lambda: loader.CudaToolkit(problem="nvcc not found")
    )
    with pytest.raises(build.ConfigError, match="nvcc not found"):
        build.resolve_config("cuda", arch_list="9.0")
    assert build.main(["--backend", "cuda", "--arch", "9.0"]) == exitcodes.ENV_BROKEN


def test_missing_torch_is_an_environment_failure(monkeypatch, capsys):
    real_find_spec = loader.importlib.util.find_spec
    monkeypatch.setattr(
        loader.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else real_find_spec(name, *a),
    )
    assert build.main(["--backend", "cpu"]) == exitcodes.ENV_BROKEN
    assert "torch is not installed" in capsys.readouterr().err


def test_torch_versions_are_read_without_importing_torch():
    code = (
        "import sys; from flashmoe_science import _loader; v = _loader.torch_versions(); "
        "assert 'torch' not in sys.modules, 'torch was imported'; print(v)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_nvcc_threads_follow_archs_and_max_jobs(cuda_machine, monkeypatch):
    config = build.resolve_config("cuda", arch_list="8.0;8.9;9.0")
    monkeypatch.delenv("MAX_JOBS", raising=False)
    assert loader.nvcc_threads(config) == 3
    monkeypatch.setenv("MAX_JOBS", "1")
    assert loader.nvcc_threads(config) == 1


def test_the_production_unit_splits_ptxas_and_the_plant_unit_the_whole_compile(
    cuda_machine, monkeypatch
):
    """The production unit splits ptxas alone (its SASS stays what it is) over every core; the
    plant unit, built beside it, splits nvcc's optimizer too over the cores but one. Never above
    MAX_JOBS, never on one thread, and outside the build's hash."""
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    production = build.resolve_config("cuda", arch_list="9.0a")
    plants = build.resolve_config("cuda", arch_list="9.0a", defines=[loader.PLANT_DEFINE])
    assert loader.nvcc_split_flags(production) == ["-Xptxas=--split-compile=16"]
    assert loader.nvcc_split_flags(plants) == ["--split-compile=15"]
    monkeypatch.setenv("MAX_JOBS", "4")
    assert loader.nvcc_split_flags(production) == ["-Xptxas=--split-compile=4"]
    assert loader.nvcc_split_flags(plants) == ["--split-compile=4"]
    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("MAX_JOBS")
    assert loader.nvcc_split_flags(production) == ["-Xptxas=--split-compile=2"]
    assert loader.nvcc_split_flags(plants) == [], "one thread: no split"
    monkeypatch.setenv("MAX_JOBS", "1")
    assert loader.nvcc_split_flags(production) == []
    for config in (production, plants):
        assert "split-compile" not in " ".join(loader.compile_flags(config)["cuda_cflags"])


# --------------------------------------------------------------------------------------------------
# Streaming, locking
# --------------------------------------------------------------------------------------------------


def test_ninja_progress_shows_the_file_not_the_command():
    nvcc = (
        "[1/2] /usr/local/cuda/bin/nvcc -MD -MF a.o.d "
        + "-Ifoo " * 300
        + "-c /repo/csrc/flashmoe_science.cu -o a.o"
    )
    assert loader.ninja_progress(nvcc) == "[1/2] nvcc flashmoe_science.cu"
    link = "[2/2] c++ flashmoe_science.cuda.o -shared -fopenmp -L/x -lc10 -o flashmoe_science_C.so"
    assert loader.ninja_progress(link) == "[2/2] link flashmoe_science_C.so"
    assert loader.ninja_progress("ptxas info    : Used 8 registers") is None


def test_streaming_logs_every_line_and_beats_during_silence(tmp_path):
    script = "import time; print('[1/2] c++ -c /x/unit.cpp -o unit.o', flush=True); time.sleep(0.7); print('bye')"
    lines: list[str] = []
    beats: list[float] = []
    run = _toolkit.run_streaming(
        [sys.executable, "-c", script],
        dict(os.environ),
        tmp_path / "build.log",
        on_line=lines.append,
        heartbeat_s=0.2,
        on_silence=beats.append,
    )
    assert run.returncode == 0 and not run.timed_out and run.text.splitlines()[-1] == "bye"
    assert lines == ["[1/2] c++ -c /x/unit.cpp -o unit.o", "bye"] and beats
    assert "bye" in (tmp_path / "build.log").read_text()


def test_streaming_kills_the_tool_on_timeout(tmp_path):
    started = time.monotonic()
    run = _toolkit.run_streaming(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        dict(os.environ),
        tmp_path / "tool.log",
        timeout_s=1.0,
    )
    assert run.timed_out and run.returncode is None and run.text == "up\n"
    assert time.monotonic() - started < 10


def test_streaming_in_a_thread_stops_its_tool_when_asked(tmp_path):
    """sanitize runs its tools from worker threads, which Ctrl-C never reaches: the main thread
    sets `stop`, and each run kills its tool's process group and raises KeyboardInterrupt."""
    stop, raised = threading.Event(), []
    pid_file = tmp_path / "pid"
    script = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(30)"
    )

    def run() -> None:
        try:
            _toolkit.run_streaming(
                [sys.executable, "-c", script], dict(os.environ), tmp_path / "tool.log", stop=stop
            )
        except KeyboardInterrupt:
            raised.append(time.monotonic())

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    asked = time.monotonic()
    stop.set()
    worker.join(timeout=15)
    assert raised and raised[0] - asked < 5, "the run raised soon after it was asked to stop"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the tool is gone


def test_lock_excludes_a_second_builder(tmp_path):
    with (
        loader._build_lock(tmp_path, print),
        open(tmp_path / "build.lock") as other,
        pytest.raises(BlockingIOError),
    ):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "build.lock") as other:  # released afterwards
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


# --------------------------------------------------------------------------------------------------
# Real builds of a tiny unit (CPU backend)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_unit(tmp_path, monkeypatch):
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "flashmoe_science.cpp").write_text(TINY_UNIT)
    (sources / "twice.h").write_text("constexpr int kFactor = 2;\n")
    monkeypatch.setenv("FLASHMOE_BUILD_ROOT", str(tmp_path / "build"))
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path / "reports"))
    return sources


@pytest.mark.slow
def test_real_build_then_up_to_date_then_rebuild_on_change(
    tiny_unit, tmp_path, capsys, monkeypatch
):
    # the CLI builds what FLASHMOE_BUILD_DEFINES names; a run under a define has one set
    monkeypatch.delenv(loader.DEFINES_VAR, raising=False)
    config = build.resolve_config("cpu", sources_dir=tiny_unit)
    result = build.build(config)
    assert result.cold and result.library == loader.library_path(config) and result.library.exists()
    assert result.library.parent == tmp_path / "build" / "torch{}-cpu".format(
        config.torch_version.split("+")[0]
    )
    record = json.loads((result.library.parent / "build.json").read_text())
    assert record["status"] == "ok" and record["backend"] == "cpu"
    report = json.loads((tmp_path / "reports" / "build.json").read_text())
    assert report["hash"] == record["hash"] and report["cold"] and report["kernels"] == []
    assert report["provenance"]["run_id"]
    assert "[2/2] link flashmoe_science_C.so" in capsys.readouterr().out
    assert (result.library.parent / "build.log").stat().st_size > 0

    # the library loads and computes
    assert ctypes.CDLL(str(result.library)).twice(21) == 42

    start = time.perf_counter()
    again = build.build(build.resolve_config("cpu", sources_dir=tiny_unit))
    assert not again.cold and time.perf_counter() - start < 5
    assert build.main(["--backend", "cpu", "--sources-dir", str(tiny_unit)]) == exitcodes.OK
    assert capsys.readouterr().out.splitlines()[-1].startswith("build: up to date (")
    assert build.ensure_built("cpu", sources_dir=tiny_unit) == result.library

    # a whole `python -m ... build` on an up-to-date tree, interpreter start included
    start = time.perf_counter()
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashmoe_science.pipeline.build.unit",
            "--backend",
            "cpu",
            "--sources-dir",
            str(tiny_unit),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and "up to date" in cli.stdout and time.perf_counter() - start < 5

    (tiny_unit / "twice.h").write_text("constexpr int kFactor = 3;\n")  # a header counts too
    assert not loader.is_up_to_date(config)


def _recorded_build(config) -> None:
    """config's build directory as a finished build leaves it (the library's bytes aside)."""
    config.build_dir.mkdir(parents=True, exist_ok=True)
    loader.library_path(config).write_bytes(b"a library")
    (config.build_dir / "kernels.json").write_text("[]\n")
    (config.build_dir / "build.log").write_text("the compiler's log\n")
    record = loader._record(config, loader.source_hash(config), 12.5, True)
    loader.write_json(loader.record_path(config), record)


def test_reuse_build_gives_a_tree_with_the_same_sources_the_build(tiny_unit, tmp_path, monkeypatch):
    config = loader.resolve_config("cpu", sources_dir=tiny_unit)
    assert not loader.reuse_build(config, tiny_unit, tmp_path / "none")  # nothing built yet
    assert not (tmp_path / "none").exists()
    _recorded_build(config)
    theirs = tmp_path / "base" / "csrc"
    shutil.copytree(tiny_unit, theirs)
    root = tmp_path / "base.build"
    dest = root / config.key
    library = dest / loader.library_path(config).name

    def their_build_is_up_to_date() -> bool:
        """What their tree's loader sees, with their build root."""
        with monkeypatch.context() as their_env:
            their_env.setenv("FLASHMOE_BUILD_ROOT", str(root))
            their_config = loader.resolve_config("cpu", sources_dir=theirs)
            assert their_config.build_dir == dest
            return loader.is_up_to_date(their_config)

    assert loader.reuse_build(config, theirs, root)
    assert their_build_is_up_to_date()  # their build compiles nothing
    assert library.read_bytes() == b"a library"
    record = json.loads((dest / "build.json").read_text())
    assert record["so_path"] == str(library) and record["log"] == str(dest / "build.log")
    assert record["source"] == loader.display_path(theirs / "flashmoe_science.cpp")
    assert (dest / "kernels.json").read_text() == "[]\n"
    assert [p.name for p in root.iterdir()] == [config.key]  # no staging folder left behind

    # theirs already up to date: kept as it is
    library.write_bytes(b"their own library")
    assert loader.reuse_build(config, theirs, root)
    assert library.read_bytes() == b"their own library"

    # one byte of theirs differs: nothing reused, their stale build untouched
    (theirs / "twice.h").write_text("constexpr int kFactor = 3;\n")
    assert not loader.reuse_build(config, theirs, root)
    assert not their_build_is_up_to_date()
    assert library.read_bytes() == b"their own library"

    # the same bytes again, their record stale: replaced by the up-to-date build
    (theirs / "twice.h").write_text((tiny_unit / "twice.h").read_text())
    loader.write_json(dest / "build.json", {**record, "hash": "stale"})
    assert not their_build_is_up_to_date()
    assert loader.reuse_build(config, theirs, root)
    assert their_build_is_up_to_date() and library.read_bytes() == b"a library"

    # other defines hash otherwise: the head's build without them is not theirs
    with_define = dataclasses.replace(config, defines=("FLASHMOE_PLANT_BUG=1",))
    assert not loader.reuse_build(with_define, theirs, tmp_path / "defined.build")


def _unit_builder(tiny_unit, monkeypatch):
    """(config, build_with, compiled): the tiny unit's builds, their compile faked (the library
    names the sources' hash); build_with(factor) builds the sources with that factor and checks
    the library in place is theirs; `compiled` lists the hashes compiled."""
    compiled = []

    def fake_compile(config, digest, start, say, heartbeat_s):
        compiled.append(digest)
        loader.library_path(config).write_bytes(f"built from {digest}".encode())
        record = loader._record(config, digest, 1.0, True)
        loader.write_json(loader.record_path(config), record)
        return loader.BuildResult(
            config, loader.library_path(config), True, 1.0, Path(), "", record
        )

    monkeypatch.setattr(loader, "_compile", fake_compile)
    header = tiny_unit / "twice.h"
    config = loader.resolve_config("cpu", sources_dir=tiny_unit)

    def build_with(factor: int, force: bool = False) -> tuple[bool, str, list[str]]:
        header.write_text(f"constexpr int kFactor = {factor};\n")
        said = []
        result = loader.build(config, force=force, say=said.append)
        assert loader.is_up_to_date(config)
        digest = loader.source_hash(config)
        assert loader.library_path(config).read_bytes() == f"built from {digest}".encode()
        assert result.record["hash"] == digest
        return result.cold, digest, said

    return config, build_with, compiled


def test_sources_built_before_are_restored_not_compiled_again(tiny_unit, monkeypatch):
    """A git bisect or a branch switch goes back to sources built before: their build comes back
    from <key>.previous, the KEEP_PREVIOUS most recently used kept."""
    config, build_with, compiled = _unit_builder(tiny_unit, monkeypatch)
    assert build_with(2)[0] and build_with(3)[0]  # two sources, two compiles
    (config.build_dir / "flashmoe_science.o").write_bytes(b"the object of kFactor = 3")
    cold, digest_2, said = build_with(2)  # back to the first: restored, nothing compiled
    assert not cold and len(compiled) == 2 and "restored from" in said[0]
    assert not (config.build_dir / "flashmoe_science.o").exists()  # not the restored sources'
    assert not build_with(3)[0] and len(compiled) == 2  # and the second, kept when 2 came back

    assert all(build_with(f)[0] for f in (4, 5, 6))  # three more sources
    kept = sorted(p.name for p in loader.previous_dir(config).iterdir())
    assert len(kept) == loader.KEEP_PREVIOUS and digest_2[:20] not in kept  # the oldest dropped
    assert build_with(2)[0] and len(compiled) == 6  # so compiled again

    assert build_with(2, force=True)[0] and len(compiled) == 7  # --force always compiles
    slot = loader.previous_dir(config) / loader.source_hash(config)[:20]
    build_with(5)
    assert not build_with(2)[0]  # 2 was kept when 5 was restored
    build_with(5)
    record = json.loads((slot / "build.json").read_text())
    loader.write_json(slot / "build.json", {**record, "hash": "another"})  # damaged: not trusted
    assert build_with(2)[0]


def test_the_oldest_kept_build_comes_back_whole(tiny_unit, monkeypatch):
    """Back to the least recently used of KEEP_PREVIOUS kept builds (a bisect's first step back):
    keeping the current build must not drop the slot being restored, whose library comes back
    (the restore's check of the library is build_with's)."""
    config, build_with, compiled = _unit_builder(tiny_unit, monkeypatch)
    for factor in range(2, 3 + loader.KEEP_PREVIOUS):  # 2 .. 5: slots 2, 3 and 4 kept
        build_with(factor)
    cold, digest_2, said = build_with(2)
    assert not cold and "restored from" in said[0] and len(compiled) == loader.KEEP_PREVIOUS + 1
    kept = {p.name for p in loader.previous_dir(config).iterdir()}
    assert all(p.is_dir() for p in loader.previous_dir(config).iterdir())
    assert len(kept) == loader.KEEP_PREVIOUS and digest_2[:20] in kept  # 2 used last, kept
    assert not build_with(5)[0]  # and the build it replaced, kept in its turn


def test_a_slot_that_is_not_a_folder_is_replaced(tiny_unit, monkeypatch):
    """A kept build's slot left as an empty file (an earlier version touched a slot it had just
    dropped) does not stop the next build: it is replaced by the build it names."""
    config, build_with, compiled = _unit_builder(tiny_unit, monkeypatch)
    _, digest_2, _ = build_with(2)
    loader.previous_dir(config).mkdir()
    (loader.previous_dir(config) / digest_2[:20]).write_bytes(b"")
    assert build_with(3)[0]
    assert not build_with(2)[0] and len(compiled) == 2  # kept whole when 3 was built


@pytest.mark.slow
def test_real_build_with_syntax_error_reports_file_and_line(tiny_unit, capsys):
    (tiny_unit / "flashmoe_science.cpp").write_text(BROKEN_UNIT)
    config = build.resolve_config("cpu", sources_dir=tiny_unit)
    with pytest.raises(build.BuildError) as excinfo:
        build.build(config, quiet=True)
    message = str(excinfo.value)
    assert f"{tiny_unit / 'flashmoe_science.cpp'}:3:" in message.splitlines()[0]
    assert len(message.splitlines()) <= 10 and message.splitlines()[-1].startswith("next: fix ")
    assert excinfo.value.log_path.exists()
    assert json.loads((config.build_dir / "build.json").read_text())["status"] == "failed"
    assert not loader.is_up_to_date(config)

    assert (
        build.main(["--backend", "cpu", "--sources-dir", str(tiny_unit), "--quiet"])
        == exitcodes.BUILD_FAILED
    )
    err = capsys.readouterr().err
    assert "flashmoe_science.cpp:3" in err and "Traceback" not in err


def test_help_lists_the_options():
    out = subprocess.run(
        [sys.executable, "-m", "flashmoe_science.pipeline.build.unit", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "--arch LIST" in out.stdout and "--define NAME=VAL" in out.stdout


def test_missing_unit_is_a_build_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHMOE_BUILD_ROOT", str(tmp_path / "build"))
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path / "reports"))
    assert (
        build.main(["--backend", "cpu", "--sources-dir", str(tmp_path)]) == exitcodes.BUILD_FAILED
    )
    err = capsys.readouterr().err
    assert "flashmoe_science.cpp does not exist" in err and "write it" not in err
    assert "next: point --sources-dir at a directory that holds flashmoe_science.cpp" in err
    report = json.loads((tmp_path / "reports" / "build.json").read_text())
    assert report["status"] == "failed" and "does not exist" in report["error"]


# --------------------------------------------------------------------------------------------------
# Dynamic shared memory per kernel
# --------------------------------------------------------------------------------------------------


def sm90_fwd_smem(
    head_dim: int, head_dim_v: int, block_n: int, warpgroups: int, stages: int
) -> int:
    """Sm90FwdTiles::kSmemBytes: Q (64 rows a math warpgroup), K and V in `stages` buffers, with
    two stages of at most 128 keys up to d=128 the output's staging buffer, then 128 bytes of
    mbarriers (csrc/flash_fwd_sm90_kernel.cuh)."""
    rows = 64 * warpgroups
    staged = stages == 2 and block_n <= 128 and head_dim <= 128
    tiles = rows * head_dim + stages * block_n * (head_dim + head_dim_v)
    return (tiles + (rows * head_dim_v if staged else 0)) * 2 + 128


def traits_smem(kernel: str) -> int:
    """The shared memory a kernel's traits ask for, by the formulas of csrc/flash_fwd_kernel.cuh
    (FwdTraits::kSmemBytes), csrc/flash_fwd_sm90_kernel.cuh (Sm90FwdTraits), csrc/flash_decode_kernel.cuh
    (DecodeTraits::kSmemBytes), csrc/flash_bwd_kernel.cuh (BwdTraits, BwdDqTraits) and
    csrc/flash_bwd_sm90_kernel.cuh (Sm90BwdTraits, Sm90BwdWsTraits, Sm90BwdWideTraits)."""
    if match := re.search(r"FwdTraits<(\d+), (\d+), (\d+), \d+, (?:true|false)>", kernel):
        head_dim, block_m, block_n = (int(g) for g in match.groups())
        return (block_m + 2 * block_n) * head_dim * 2  # Q tile + K and V tiles, 2-byte elements
    if match := re.search(r"DecodeTraits<(\d+), (\d+)>", kernel):
        head_dim, stages = (int(g) for g in match.groups())
        keys = 64 if head_dim <= 128 else 32  # 16 keys a warp: 4 warps, or 2 past d=128
        return stages * 2 * keys * head_dim * 2  # per stage a K tile and a V tile
    if match := re.search(r"BwdTraits<(\d+), (\d+), (\d+), (\d+)>", kernel):
        head_dim, block_m, block_n, warps = (int(g) for g in match.groups())
        # K, V, Q and dO tiles, dS^T (keys x queries), P^T as well where fewer than 16 keys a warp
        # make warps share keys, the query block's lse and delta (fp32)
        key_tiles = 2 if block_n < 16 * warps else 1
        return (
            (2 * block_n + 2 * block_m) * head_dim * 2
            + key_tiles * block_n * block_m * 2
            + 2 * block_m * 4
        )
    if match := re.search(r"BwdDqTraits<(\d+), (\d+), (\d+), \d+>", kernel):
        head_dim, block_m, block_n = (int(g) for g in match.groups())
        return (2 * block_m + 2 * block_n) * head_dim * 2  # Q, dO, K and V tiles
    if match := re.search(r"Sm90BwdWideTraits<(\d+), (\d+)>", kernel):
        head_dim, head_dim_v = (int(g) for g in match.groups())
        block_n = block_m = 64
        # K and V, Q and dO double-buffered (q's and k's head dim, v's), P and dS (queries x keys),
        # then lse and delta double-buffered (fp32), and where Q and dO come by TMA two mbarriers
        tma = loader.switch_on("FLASHMOE_BWD_WIDE_TMA") and loader.switch_on("FLASHMOE_BWD_WS")
        return (
            (block_n + 2 * block_m) * (head_dim + head_dim_v) * 2
            + 2 * block_m * block_n * 2
            + 4 * block_m * 4
            + 2 * 8 * tma
        )
    if match := re.search(r"Sm90BwdWsTraits<(\d+)>", kernel):
        head_dim = int(match.group(1))
        block_n, block_m = 128, 128 if head_dim == 64 else 64
        # K and V, Q and dO double-buffered, dS^T double-buffered, lse and delta double-buffered
        # (fp32), one 64 x 64 fp32 dQ tile a math warpgroup, four mbarriers
        return (
            (2 * block_n + 4 * block_m) * head_dim * 2
            + 2 * block_n * block_m * 2
            + 4 * block_m * 4
            + 2 * 64 * 64 * 4
            + 4 * 8
        )
    if match := re.search(r"Sm90BwdTraits<(\d+)>", kernel):
        head_dim = int(match.group(1))
        block_n, block_m = 128, 128 if head_dim == 64 else 64
        # K and V, Q and dO double-buffered, dS^T, then lse and delta double-buffered (fp32)
        return (2 * block_n + 4 * block_m) * head_dim * 2 + block_n * block_m * 2 + 4 * block_m * 4
    if match := re.search(r"Sm90FwdTraits<(\d+), (\d+), (\d+), (\d+)>", kernel):
        head_dim, block_n, warpgroups, stages = (int(g) for g in match.groups())
        return sm90_fwd_smem(head_dim, head_dim, block_n, warpgroups, stages)
    if match := re.search(r"Sm90FwdDvTraits<(\d+), (\d+), (\d+), (\d+), (\d+)>", kernel):
        return sm90_fwd_smem(*(int(g) for g in match.groups()))
    assert re.search(
        r"split_kv_combine|bwd_preprocess|bwd_convert_dq|varlen_offsets_check", kernel
    ), kernel
    return 0


# As nvcc names two of the kernels (demangled by c++filt below), and the unit's launch table in the
# shape flashmoe::cuda::kernel_launches writes it.
PTXAS_CURRENT = """\
ptxas info    : Compiling entry function '_ZN8flashmoe4cuda16flash_fwd_kernelINS0_9FwdTraitsILi128ELi64ELi64ELi4ELb0EEE6__halfEEvNS_15AttentionParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN8flashmoe4cuda16flash_fwd_kernelINS0_9FwdTraitsILi128ELi64ELi64ELi4ELb0EEE6__halfEEvNS_15AttentionParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN8flashmoe4cuda19flash_decode_kernelINS0_12DecodeTraitsILi128ELi3EEE13__nv_bfloat16EEvNS_15AttentionParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN8flashmoe4cuda19flash_decode_kernelINS0_12DecodeTraitsILi128ELi3EEE13__nv_bfloat16EEvNS_15AttentionParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 1 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z8mysteryv' for 'sm_90'
ptxas info    : Used 8 registers, used 0 barriers
"""
LAUNCH_TABLE = """\
flashmoe::cuda::flash_fwd_kernel<flashmoe::cuda::FwdTraits<128, 64, 64, 4, false>, __half>\t49152
flashmoe::cuda::flash_decode_kernel<flashmoe::cuda::DecodeTraits<128, 3>, __nv_bfloat16>\t98304
flashmoe::cuda::split_kv_combine_kernel<__half, 128>\t0
"""


@pytest.mark.skipif(not shutil.which("c++filt"), reason="no c++filt (binutils)")
def test_dynamic_smem_joins_the_ptxas_rows():
    kernels = compiler_output.parse_ptxas(PTXAS_CURRENT)
    table = build.parse_launch_table(LAUNCH_TABLE)
    build.add_dynamic_smem(kernels, table)
    fwd, decode, mystery = kernels
    assert fwd["kernel"] == "flash_fwd_kernel<FwdTraits<128, 64, 64, 4, false>, __half>"
    # 64-row tile at d=128: 48 KB, the figure csrc/flash_api_cuda.cuh quotes for config 2
    assert (fwd["smem_bytes"], fwd["dynamic_smem"]) == (0, 49152) == (0, traits_smem(fwd["kernel"]))
    # three stages of 64 keys at d=128: 96 KB; the arrival flag is its only static smem
    assert (decode["smem_bytes"], decode["dynamic_smem"]) == (1, 98304)
    assert decode["dynamic_smem"] == traits_smem(decode["kernel"])
    assert mystery["dynamic_smem"] is None  # a kernel the unit does not report: unknown, not 0
    rows = build.format_resource_table(kernels)
    assert "dynamic smem" in rows[0] and "49152" in rows[1] and rows[3].split()[-2] == "?"
    assert len({len(row) for row in rows}) == 1
    build.add_dynamic_smem(kernels, None)  # an older unit without the table
    assert all(k["dynamic_smem"] is None for k in kernels)


# The wgmma kernels as nvcc names them in a build for sm_89 and sm_90a (real lines, CUDA 13.0; the
# performance-loss line in the shape ptxas prints it for a kernel whose wgmma pipeline serializes),
# and their rows of the unit's launch table.
PTXAS_SM90A = """\
ptxas info    : Compiling entry function '_ZN8flashmoe4cuda21flash_fwd_sm90_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE13__nv_bfloat16EEvNS_15AttentionParamsE' for 'sm_89'
ptxas info    : Function properties for _ZN8flashmoe4cuda21flash_fwd_sm90_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE13__nv_bfloat16EEvNS_15AttentionParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 4 registers, used 0 barriers, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN8flashmoe4cuda21flash_fwd_sm90_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE13__nv_bfloat16EEvNS_15AttentionParamsE' for 'sm_90a'
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function '_ZN8flashmoe4cuda21flash_fwd_sm90_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE13__nv_bfloat16EEvNS_15AttentionParamsE'
ptxas info    : Function properties for _ZN8flashmoe4cuda21flash_fwd_sm90_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE13__nv_bfloat16EEvNS_15AttentionParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 198 registers, used 1 barriers
ptxas info    : Compile time = 364.687 ms
ptxas info    : Compiling entry function '_ZN8flashmoe4cuda28flash_fwd_sm90_varlen_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE6__halfEEvNS_15AttentionParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN8flashmoe4cuda28flash_fwd_sm90_varlen_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE6__halfEEvNS_15AttentionParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 16 bytes smem
ptxas info    : Compiling entry function '_ZN8flashmoe4cuda28flash_fwd_sm90_varlen_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE13__nv_bfloat16EEvNS_15AttentionParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN8flashmoe4cuda28flash_fwd_sm90_varlen_kernelINS0_13Sm90FwdTraitsILi128ELi128ELi2EEE13__nv_bfloat16EEvNS_15AttentionParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 16 bytes smem
"""
LAUNCH_TABLE_SM90A = """\
flashmoe::cuda::flash_fwd_sm90_kernel<flashmoe::cuda::Sm90FwdTraits<128, 128, 2>, __nv_bfloat16>\t98304
flashmoe::cuda::flash_fwd_sm90_varlen_kernel<flashmoe::cuda::Sm90FwdTraits<128, 128, 2>, __half>\t98304
flashmoe::cuda::flash_fwd_sm90_varlen_kernel<flashmoe::cuda::Sm90FwdTraits<128, 128, 2>, __nv_bfloat16>\t98304
"""


@pytest.mark.skipif(not shutil.which("c++filt"), reason="no c++filt (binutils)")
def test_the_wgmma_kernels_get_their_rows_and_a_serialized_pipeline_is_a_warning(capsys):
    kernels = compiler_output.parse_ptxas(PTXAS_SM90A)
    build.add_dynamic_smem(kernels, build.parse_launch_table(LAUNCH_TABLE_SM90A))
    assert [(k["kernel"], k["arch"], k["registers"], k["dynamic_smem"]) for k in kernels] == [
        ("flash_fwd_sm90_kernel<Sm90FwdTraits<128, 128, 2>, __nv_bfloat16>", "sm_89", 4, 98304),
        ("flash_fwd_sm90_kernel<Sm90FwdTraits<128, 128, 2>, __nv_bfloat16>", "sm_90a", 198, 98304),
        ("flash_fwd_sm90_varlen_kernel<Sm90FwdTraits<128, 128, 2>, __half>", "sm_90a", 168, 98304),
        (
            "flash_fwd_sm90_varlen_kernel<Sm90FwdTraits<128, 128, 2>, __nv_bfloat16>",
            "sm_90a",
            168,
            98304,
        ),
    ]
    assert kernels[3]["smem_bytes"] == 16
    # the advice lands on the sm_90a kernel it names, not on the sm_89 one of the same name
    assert [k["performance_loss"] for k in kernels] == [
        None,
        "C7511: wgmma.mma_async instructions are serialized due to insufficient register "
        "resources for the wgmma pipeline",
        None,
        None,
    ]
    rows = build.format_resource_table(kernels)
    assert len({len(row) for row in rows}) == 1 and " sm_90a " in rows[2]
    build._print_spill_warnings(kernels)
    assert capsys.readouterr().out == (
        "WARNING: flash_fwd_sm90_kernel<Sm90FwdTraits<128, 128, 2>, __nv_bfloat16> (sm_90a): "
        "ptxas C7511: wgmma.mma_async instructions are serialized due to insufficient register "
        "resources for the wgmma pipeline\n"
    )


def test_performance_loss_naming_an_inlined_function_goes_to_the_entry_being_compiled():
    log = PTXAS_SM90A.replace(
        "in the function '_ZN8flashmoe4cuda21flash_fwd_sm90_kernelINS0_13Sm90FwdTraitsILi128ELi128"
        "ELi2EEE13__nv_bfloat16EEvNS_15AttentionParamsE'",
        "in the function '_ZN8flashmoe4cuda7softmaxEv'",
    )
    kernels = compiler_output.parse_ptxas(log, demangle=identity)
    assert [bool(k["performance_loss"]) for k in kernels] == [False, True, False, False]


# CUDA 13's ptxas prints a run's advice (and spill warnings) before the entries it compiles: here
# the sm_89 run first, then the sm_90a run with its advice for the wgmma kernel at the top.
_FWD90 = "_ZN8flashmoe4cuda21flash_fwd_sm90_kernelINS0_13Sm90FwdTraitsILi64ELi128ELi2ELi3EEE13__nv_bfloat16EEvNS_15AttentionParamsE"
_DECODE = "_ZN8flashmoe4cuda19flash_decode_kernelINS0_12DecodeTraitsILi128ELi3EEE13__nv_bfloat16EEvNS_15AttentionParamsE"


def _entry(name: str, arch: str, registers: int) -> str:
    return (
        f"ptxas info    : Compiling entry function '{name}' for '{arch}'\n"
        f"ptxas info    : Function properties for {name}\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        f"ptxas info    : Used {registers} registers, used 1 barriers\n"
    )


PTXAS_13 = (
    _entry(_FWD90, "sm_89", 4)
    + _entry(_DECODE, "sm_89", 96)
    + "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
    "serialized due to non wgmma instructions reading accumulator registers of  a wgmma between "
    f"start and end of the pipeline stage in the function '{_FWD90}'\n"
    + _entry(_DECODE, "sm_90a", 96)
    + _entry(_FWD90, "sm_90a", 168)
)


def test_ptxas_13_advice_before_its_entries_goes_to_the_entry_of_that_run():
    """ptxas 13 prints the advice ahead of the run's entries; it belongs to the sm_90a entry of
    the kernel it names (before: dropped, or given to the sm_89 entry parsed before it)."""
    kernels = compiler_output.parse_ptxas(PTXAS_13, demangle=identity)
    assert [(k["arch"], k["registers"], bool(k["performance_loss"])) for k in kernels] == [
        ("sm_89", 4, False),
        ("sm_89", 96, False),
        ("sm_90a", 96, False),
        ("sm_90a", 168, True),
    ]
    assert kernels[3]["performance_loss"].startswith("C7514: wgmma.mma_async instructions are")
    alone = compiler_output.parse_ptxas(PTXAS_13[PTXAS_13.index("ptxas info    : (C75") :])
    assert [bool(k["performance_loss"]) for k in alone] == [False, True]


def newest_cuda_build() -> Path | None:
    """The library of this checkout's newest successful full CUDA build of these very sources
    (nox -s build on a GPU machine, nox -s compile elsewhere), if any: a planted or restricted
    (`--only`) build, which carries defines, holds other kernels, and a build of other sources (a
    branch switched away from) other ones."""
    records = []
    for path in loader.build_root().glob("*/build.json"):
        with contextlib.suppress(OSError, ValueError, RuntimeError, loader.ConfigError):
            record = json.loads(path.read_text())
            library = Path(str(record.get("so_path")))
            if (
                record.get("backend") == "cuda"
                and record.get("status") == "ok"
                and not record.get("defines")
                and library.exists()
                and is_current_build(record)
            ):
                records.append((path.stat().st_mtime, library))
    return max(records)[1] if records else None


def is_current_build(record: dict) -> bool:
    """Whether a build's record hashes as the checkout's sources would now, on its own archs."""
    config = loader.resolve_config("cuda", arch_list=record.get("arch_list"), only="")
    return record.get("hash") == loader.source_hash(config)


@pytest.mark.skipif(
    newest_cuda_build() is None, reason="no CUDA build of these sources here (nox -s build/compile)"
)
def test_dynamic_smem_is_what_each_launch_asks_for():
    library = newest_cuda_build()
    table = build.launch_table(library)
    # 2 dtypes x (forward kernels: 6 at d=128, where configuration 7 is a kernel of its own, and 6
    # at d=64, where configuration 6 is + 2 head dims x (4 packed-batch (varlen) ones + their
    # offset check + the paged decode kernel + the combine kernel + 3 backward configurations with
    # and without dQ atomics + the dQ pass + the pre-pass) + at d=192 and 256, which have no wgmma
    # kernels and where configuration 4 is 1's kernel, 3 forward kernels + 2 packed-batch ones +
    # the same others with 2 backward configurations + the dQ conversion) + at d=192 and 256 the
    # wgmma forward (5 to 7 one kernel) and its packed-batch one, + each sm_90a forward kernel's
    # twin with windows, softcap and sinks (6 forward and 4 packed-batch ones), + at d=192 with
    # v's 128 the wgmma forward of narrow V (5 to 7 one kernel), dense and packed, with their twins,
    # + configuration 5's 128 tile run padded, dense and packed, with their twins, + the wgmma
    # backward's 128 tile run padded, with and without dQ atomics, + the wgmma backward past 128
    # (at 192 whole and with v's 128, at 256), with and without dQ atomics, + configuration 5's
    # padded tile with its MMAs over 96 columns, dense and packed, with their twins, + the wgmma
    # backward's 128 tile warp-specialized (at 64, 128, padded onto 128 and padded with its
    # products over 96 columns), with and without dQ atomics (none in a build with
    # -DFLASHMOE_BWD_WS=0)
    per_head_dim = 4 + 1 + 1 + 1 + 3 * 2 + 1 + 1
    per_wide_head_dim = 3 + 2 + 1 + 1 + 1 + 2 * 2 + 1 + 1 + 2
    assert table is not None
    ws = sum("Sm90BwdWsTraits" in name for name in table) // 2
    assert ws in (0, (3 + loader.switch_on("FLASHMOE_BWD_WS_MMA96", ())) * 2)
    assert len(table) == 2 * (
        6 + 6 + 2 * per_head_dim + 2 * per_wide_head_dim + 1 + 10 + 4 + 2 * 4 + 2 + 6 + ws
    )
    # (the padded tiles' twins among them: a padded tile names its Sm90FwdTraits)
    assert sum(name.endswith(", true>") and "Sm90FwdTraits" in name for name in table) == 2 * 13
    assert sum(name.endswith(", true>") and "Sm90FwdDvTraits" in name for name in table) == 2 * 2
    assert sum("Sm90PaddedTraits" in name for name in table) == 2 * 8
    assert sum("Sm90PaddedTraits" in name and ", 96>" in name for name in table) == 2 * 4
    assert sum("Sm90BwdPaddedTraits" in name for name in table) == 2 * (2 + ws // 3)
    assert sum("Sm90BwdWideTraits" in name for name in table) == 2 * 6
    assert {name: traits_smem(name) for name in table} == table
    kernels = json.loads((library.parent / build.KERNELS_NAME).read_text())["kernels"]
    ours = [k for k in kernels if k["kernel"] in table]
    assert len(ours) >= len(table) and all(
        k["dynamic_smem"] == traits_smem(k["kernel"]) for k in ours
    )


def test_first_use_shows_progress_on_stderr_and_writes_no_report(tiny_unit, tmp_path, capsys):
    library = loader.ensure_built("cpu", sources_dir=tiny_unit)
    captured = capsys.readouterr()
    assert captured.out == ""  # a program's own output stays clean
    assert "flashmoe_science: building the CPU unit" in captured.err
    assert "[2/2] link flashmoe_science_C.so" in captured.err and "built in" in captured.err
    assert library.exists() and not (tmp_path / "reports" / "build.json").exists()
    assert loader.ensure_built("cpu", sources_dir=tiny_unit) == library
    assert capsys.readouterr().err == ""  # up to date: silent


def test_strict_build_fails_on_a_serialized_wgmma_pipeline(monkeypatch, capsys, tmp_path):
    """`build --strict` (nox -s compile, so CI) exits 1 and names the kernel when ptxas serialized
    a wgmma pipeline; without --strict, or with no such kernel, the build passes."""
    config = build.resolve_config("cpu")
    kernels = compiler_output.parse_ptxas(PTXAS_13, demangle=identity)

    def fake_build(config, force=False, quiet=False):
        return build.BuildResult(config, tmp_path / "lib.so", False, 0.1, kernels, tmp_path, {})

    monkeypatch.setattr(build, "resolve_config", lambda *a, **k: config)
    monkeypatch.setattr(build, "build", fake_build)
    assert build.main(["--strict"]) == exitcodes.GATE_FAILED
    err = capsys.readouterr().err
    assert "serialized the wgmma pipeline of 1 kernel(s)" in err and "sm_90a" in err
    assert build.main([]) == exitcodes.OK
    kernels[3]["performance_loss"] = None
    assert build.main(["--strict"]) == exitcodes.OK


class FakeChild:
    """subprocess.Popen's stand-in: records the command and environment, writes `output` to the
    child's stdout and exits with `code`."""

    calls: typing.ClassVar[list] = []

    def __init__(self, command, stdout, env, code=0, output="", **_kwargs):
        FakeChild.calls.append((command, env))
        stdout.write(output)
        self.code = code
        if code == 0 and FakeChild.own_s is not None:  # the child's report, as its build writes it
            reports = Path(env["FLASHMOE_REPORTS_DIR"])
            reports.mkdir(parents=True, exist_ok=True)
            (reports / "build.json").write_text(json.dumps({"elapsed_s": FakeChild.own_s}))

    own_s: typing.ClassVar[float | None] = None

    def wait(self):
        return self.code

    def kill(self):
        self.code = -9


@pytest.fixture
def built_in_no_time(monkeypatch, tmp_path):
    """`build`'s own unit (the CPU one) configured and built at once: a test of what it runs beside."""
    config = build.resolve_config("cpu")
    monkeypatch.setattr(build, "resolve_config", lambda *a, **k: config)
    monkeypatch.setattr(
        build,
        "build",
        lambda config, force=False, quiet=False: build.BuildResult(
            config, tmp_path / "lib.so", False, 0.1, [], tmp_path, {}
        ),
    )
    return config


def test_plants_build_the_plant_unit_beside_and_the_report_stays_this_builds(
    monkeypatch, capsys, tmp_path, built_in_no_time
):
    """`build --plants` (the GPU job's build step) compiles the plant unit in a child beside its
    own build, for the same backend and targets, whose report goes to a folder of its own; a
    plant unit that fails fails the step with its log's end and what it breaks."""
    monkeypatch.setenv("FLASHMOE_BUILD_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv(loader.ONLY_VAR, "op=fwd")
    monkeypatch.delenv(loader.DEFINES_VAR, raising=False)
    FakeChild.calls = []
    monkeypatch.setattr(FakeChild, "own_s", 137.6)
    monkeypatch.setattr(build.subprocess, "Popen", FakeChild)
    assert build.main(["--backend", "cpu", "--arch", "8.9", "--plants"]) == exitcodes.OK
    ((command, env),) = FakeChild.calls
    assert command[1:] == [
        "-m", "flashmoe_science", "build", "--backend", "cpu", "--quiet", "--arch", "8.9",
        "--define", "FLASHMOE_PLANT_BUG=-1",
    ]  # fmt: skip
    assert env["FLASHMOE_REPORTS_DIR"] == str(tmp_path / "root" / "plants-reports")
    assert loader.ONLY_VAR not in env  # the plant unit is whole
    out = capsys.readouterr().out
    # each unit's own time: the wait for the child ends with this build, not with the child's
    assert "build: this unit done in" in out
    assert "build: the plant unit (-DFLASHMOE_PLANT_BUG=-1) done in 137.6 s" in out
    assert build.main(["--backend", "cpu"]) == exitcodes.OK and len(FakeChild.calls) == 1
    # a job under a switch: the plant unit carries it too (the planted processes load that one)
    monkeypatch.setenv(loader.DEFINES_VAR, "FLASHMOE_BWD_WS=1")
    assert build.main(["--backend", "cpu", "--plants"]) == exitcodes.OK
    assert FakeChild.calls[-1][0][-4:] == [
        "--define", "FLASHMOE_BWD_WS=1", "--define", "FLASHMOE_PLANT_BUG=-1"
    ]  # fmt: skip
    capsys.readouterr()
    monkeypatch.delenv(loader.DEFINES_VAR)

    def failing(command, stdout, env, **kwargs):
        return FakeChild(command, stdout, env, code=125, output="x.cu(3): error: planted\n")

    monkeypatch.setattr(build.subprocess, "Popen", failing)
    assert build.main(["--backend", "cpu", "--plants"]) == 125
    err = capsys.readouterr().err
    assert "build: the plant unit (-DFLASHMOE_PLANT_BUG=-1) FAILED after" in err
    assert "the planted-bug tests cannot load it" in err and "x.cu(3): error: planted" in err


def test_the_base_builds_beside_and_its_failure_is_the_benchs_to_report(
    monkeypatch, capsys, tmp_path, built_in_no_time
):
    """`build --base REF` waits for REF's build (started by basetree.start_prebuild) and says its
    own time; a base that does not build warns and leaves the step green (the bench falls back to
    a stored run and says why), where a broken plant unit fails it."""
    asked = []

    def start_base(ref, head, code=0):
        asked.append((ref, head))
        log = tmp_path / "base.log"
        with log.open("w") as out:
            child = FakeChild(["build"], out, {"FLASHMOE_REPORTS_DIR": str(tmp_path / "r")}, code)
        (log.parent / "base.log").write_text("x.cu(9): error: base\n" if code else "")
        return build.BesideBuild("the base 0123abcd4567 (main)", child, log, 0.0, tmp_path / "r")

    monkeypatch.setattr(FakeChild, "own_s", 88.0)
    monkeypatch.setattr(build, "start_base_build", start_base)
    assert build.main(["--backend", "cpu", "--base", "main"]) == exitcodes.OK
    assert asked == [("main", built_in_no_time)]
    out = capsys.readouterr().out
    assert "build: the base 0123abcd4567 (main) done in 88.0 s" in out
    monkeypatch.setattr(build, "start_base_build", lambda ref, head: start_base(ref, head, 2))
    assert build.main(["--backend", "cpu", "--base", "main"]) == exitcodes.OK
    err = capsys.readouterr().err
    assert "WARNING: the base 0123abcd4567 (main) did not build (exit 2" in err
    assert "the bench step will try again and say why" in err and "x.cu(9): error: base" in err
    assert build.main(["--backend", "cpu"]) == exitcodes.OK and len(asked) == 2


def test_build_builds_the_library_the_other_commands_load(monkeypatch):
    """`build` with FLASHMOE_BUILD_DEFINES set builds the variant that test, bench and sanitize then
    load (it built the plain library before, and the first of them compiled again); --define
    still wins."""
    seen = []

    def fake_resolve(backend, arch, defines, sources_dir=None, only=None):
        seen.append(tuple(defines))
        raise loader.ConfigError("stop here", 2)

    monkeypatch.setattr(build, "resolve_config", fake_resolve)
    monkeypatch.setenv("FLASHMOE_BUILD_DEFINES", "FLASHMOE_PLANT_BUG=3,FLASHMOE_X=1")
    assert build.main([]) == 2
    assert build.main(["--define", "FLASHMOE_Y=2"]) == 2
    monkeypatch.delenv("FLASHMOE_BUILD_DEFINES")
    assert build.main([]) == 2
    assert seen == [("FLASHMOE_PLANT_BUG=3", "FLASHMOE_X=1"), ("FLASHMOE_Y=2",), ()]


def test_a_kernel_switch_is_on_by_its_define_else_by_the_headers_default(monkeypatch):
    """switch_on reads NAME=VAL from the defines given (or FLASHMOE_BUILD_DEFINES), else the
    `#define NAME VAL` default of csrc/attention_params.h; a name with no default is an error."""
    header = (loader.default_sources_dir() / "attention_params.h").read_text()

    def default(name):
        return re.search(rf"^#define {name} (\d+)$", header, re.M).group(1) != "0"

    monkeypatch.delenv(loader.DEFINES_VAR, raising=False)
    for name in ("FLASHMOE_BWD_WS_MMA96", "FLASHMOE_BWD_CAUSAL_LPT", "FLASHMOE_PLANT_BUG"):
        assert loader.switch_on(name) is default(name), name
    assert loader.switch_on("FLASHMOE_PLANT_BUG") is False  # (a default of 0 is off)
    assert loader.switch_on("FLASHMOE_BWD_WS_MMA96", ("FLASHMOE_BWD_WS_MMA96=0",)) is False
    assert loader.switch_on("FLASHMOE_BWD_WS_MMA96", ("-DFLASHMOE_BWD_WS_MMA96=1",)) is True
    assert loader.switch_on("FLASHMOE_BWD_WS_MMA96", ("FLASHMOE_BWD_WS_MMA96",)) is True  # (-DNAME)
    monkeypatch.setenv(loader.DEFINES_VAR, "FLASHMOE_BWD_WS=1,FLASHMOE_BWD_CAUSAL_LPT=0")
    assert loader.switch_on("FLASHMOE_BWD_CAUSAL_LPT") is False
    assert loader.switch_on("FLASHMOE_BWD_CAUSAL_LPT", ()) is default("FLASHMOE_BWD_CAUSAL_LPT")
    with pytest.raises(loader.ConfigError, match="FLASHMOE_NO_SUCH_SWITCH has no default"):
        loader.switch_on("FLASHMOE_NO_SUCH_SWITCH", ())
