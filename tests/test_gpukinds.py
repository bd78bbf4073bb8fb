"""The GPU kinds GPU CI runs a leg on (flashmoe_science.pipeline.gpukinds): each kind's card,
architecture and names, and the env stage's check that a leg runs on the card its runner label
promises."""

from __future__ import annotations

import pytest

from flashmoe_science.pipeline import gpukinds
from flashmoe_science.pipeline.env import checks as env

H100 = env.Gpu(
    name="NVIDIA H100 80GB HBM3", capability="9.0", sm_count=132, memory_gib=79.2, count=1
)
H200 = env.Gpu(name="NVIDIA H200", capability="9.0", sm_count=132, memory_gib=139.8, count=1)
L4 = env.Gpu(name="NVIDIA L4", capability="8.9", sm_count=58, memory_gib=22.0, count=1)
L40S = env.Gpu(name="NVIDIA L40S", capability="8.9", sm_count=142, memory_gib=44.4, count=1)


def test_each_kind_names_its_card_arch_and_ci_names():
    assert {k: (v.arch, v.sm, v.capability) for k, v in gpukinds.KINDS.items()} == {
        "l4": ("8.9", "sm_89", "8.9"),
        "h100": ("9.0a", "sm_90a", "9.0"),
        "h200": ("9.0a", "sm_90a", "9.0"),
    }
    assert gpukinds.artifact_name("h100") == "gpu-ci-reports-h100"
    assert gpukinds.job_name("l4") == "GPU (l4)"
    assert gpukinds.leg_run_id("gpu-5-2", "h100") == "gpu-5-2-h100"
    with pytest.raises(ValueError, match="GPU kind 'a100' is not one of l4, h100, h200"):
        gpukinds.artifact_name("a100")


def test_the_kinds_match_their_cards_only():
    h100, l4 = gpukinds.KINDS["h100"], gpukinds.KINDS["l4"]
    assert h100.matches(H100.name) and not h100.matches("NVIDIA L4")
    assert l4.matches("NVIDIA L4") and not l4.matches("NVIDIA L40S") and not l4.matches(None)
    assert h100.device_problem(H100.name, "9.0") is None
    assert h100.device_problem("NVIDIA L4", "8.9") == "NVIDIA L4 is sm_89, not sm_90a"
    assert l4.device_problem("NVIDIA L40S", "8.9") == "NVIDIA L40S is not an NVIDIA L4"


def test_an_h200_is_its_own_kind_not_an_h100():
    """Same architecture, another card: each leg accepts its own card only, so a runner labelled
    h100 with an H200 in it (or the reverse) is caught by the card's name."""
    h100, h200 = gpukinds.KINDS["h100"], gpukinds.KINDS["h200"]
    assert h200.device_problem(H200.name, "9.0") is None
    assert h200.device_problem(H100.name, "9.0") == f"{H100.name} is not an NVIDIA H200"
    assert h100.device_problem(H200.name, "9.0") == "NVIDIA H200 is not an NVIDIA H100"
    assert not h200.matches("NVIDIA GH200 480GB"), "a Grace Hopper superchip is not an H200"


@pytest.mark.parametrize(
    ("gpu", "label", "status", "said"),
    [
        (H100, "h100", "ok", "NVIDIA H100 80GB HBM3 is the h100 leg's NVIDIA H100 (sm_90a)"),
        (H200, "h200", "ok", "NVIDIA H200 is the h200 leg's NVIDIA H200 (sm_90a)"),
        (H200, "h100", "fail", "NVIDIA H200 is not an NVIDIA H100: this runner is labelled h100"),
        (L4, "h100", "fail", "NVIDIA L4 is sm_89, not sm_90a: this runner is labelled h100"),
        (L40S, "l4", "fail", "NVIDIA L40S is not an NVIDIA L4: this runner is labelled l4"),
        (None, "l4", "skip", "no GPU to check against NVIDIA L4 (sm_89)"),
        (L4, "a100", "fail", "GPU kind 'a100' is not one of l4, h100, h200"),
    ],
    ids=[
        "h100-on-h100",
        "h200-on-h200",
        "h100-on-h200",
        "h100-on-l4",
        "l4-on-l40s",
        "no-gpu",
        "unknown-kind",
    ],
)
def test_a_leg_on_a_card_of_another_kind_fails_its_env_stage(gpu, label, status, said):
    check = env.check_gpu_kind(gpu, label)
    assert (check.name, check.status) == ("gpu-kind", status)
    assert check.detail.startswith(said)
    assert (check.fix != "") is (status == "fail")


def test_outside_a_leg_there_is_no_kind_to_check(monkeypatch):
    assert env.check_gpu_kind(L4, None) is None
    # every check but the extension's, which loads the library in a fresh interpreter (torch
    # imported again: ~1.6 CPU-s a run) and has nothing to do with the kind
    skipped = env.Check("extension", "skip", "not loaded by this test")
    monkeypatch.setattr(env, "check_extension", lambda *args, **kwargs: skipped)
    monkeypatch.setenv(gpukinds.KIND_VAR, "h100")
    report = env.run_checks(require_gpu=False)
    kinds = [c for c in report.checks if c.name == "gpu-kind"]
    assert len(kinds) == 1 and kinds[0].status in ("skip", "ok", "fail")
    monkeypatch.delenv(gpukinds.KIND_VAR)
    assert not [c for c in env.run_checks(require_gpu=False).checks if c.name == "gpu-kind"]
