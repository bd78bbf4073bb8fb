"""The runner image (scripts/runner/Dockerfile) and the Actions Runner Controller scale sets
(scripts/runner/arc/values-*.yaml), checked offline: nothing here builds the image or talks to a
cluster. The chart (gha-runner-scale-set 0.14.x) ships no values schema; its templates `fail` on the
rules checked here (a config URL, a secret, max >= min >= 0, a scale-set name of at most 45
characters), and the rest is what GPU CI needs of a pod: one GPU, the image, the hook, non-root."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with pre-commit (the dev dependency group)")

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "scripts" / "runner"
DOCKERFILE = (RUNNER / "Dockerfile").read_text()
VALUES = sorted((RUNNER / "arc").glob("values-*.yaml"))
TOP_LEVEL = {  # the chart's values.yaml keys (0.14.2) that a scale set may set
    "githubConfigUrl",
    "githubConfigSecret",
    "proxy",
    "maxRunners",
    "minRunners",
    "runnerGroup",
    "runnerScaleSetName",
    "scaleSetLabels",
    "githubServerTLS",
    "keyVault",
    "containerMode",
    "listenerTemplate",
    "listenerMetrics",
    "template",
    "controllerServiceAccount",
    "annotations",
    "labels",
    "namespaceOverride",
    "resourceMeta",
}


def instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [
        (m.group(1).upper(), m.group(2))
        for line in joined.splitlines()
        if (m := re.match(r"^\s*([A-Za-z]+)\s+(.*)$", line)) and not line.lstrip().startswith("#")
    ]


def test_image_base_is_the_cuda_of_torch_pinned_by_digest():
    base = [arg for op, arg in instructions() if op == "FROM"]
    assert len(base) == 1
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-devel-ubuntu24\.04@sha256:[0-9a-f]{64}", base[0])
    # the same image cpu-ci.yml compiles in
    assert base[0] in (ROOT / ".github" / "workflows" / "cpu-ci.yml").read_text()
    torch = (ROOT / "requirements" / "torch.txt").read_text()
    assert re.search(r"^torch==2\.14\.1 ", torch, re.M)
    assert "torch.version.cuda == '13.0'" in DOCKERFILE


def test_image_installs_only_hash_locked_wheels_from_one_index():
    runs = " ".join(arg for op, arg in instructions() if op == "RUN")
    installs = re.findall(r"pip install ([^&]*)", runs)
    assert len(installs) == 2
    for args in installs:
        assert "--require-hashes" in args and "--only-binary :all:" in args
        assert "--index-url https://pypi.org/simple" in args and "extra-index" not in args
    assert "PIP_CONFIG_FILE=/dev/null" in DOCKERFILE


def test_image_checks_the_runner_archive_register_sh_pins():
    register = (RUNNER / "register.sh").read_text()
    version = re.search(r'RUNNER_VERSION="([\d.]+)"', register)[1]
    sha = re.search(r'RUNNER_SHA256_PINNED="([0-9a-f]{64})"', register)[1]
    assert (
        f"ARG RUNNER_VERSION={version}" in DOCKERFILE and f"ARG RUNNER_SHA256={sha}" in DOCKERFILE
    )
    assert "sha256sum -c -" in DOCKERFILE


def test_image_runs_as_a_non_root_user_with_a_read_only_toolchain_and_the_hook():
    ops = instructions()
    users = [arg for op, arg in ops if op == "USER"]
    assert users and users[-1] == "runner"
    runs = " ".join(arg for op, arg in ops if op == "RUN")
    assert "sudo" not in runs
    assert "chmod -R a-w,a+rX /opt/torch /opt/flashmoe" in runs
    assert "chown -R root:root /opt/torch /opt/flashmoe" in runs
    assert "COPY scripts/runner/cleanup-hook.sh /opt/flashmoe/bin/cleanup-hook.sh" in DOCKERFILE
    env = (RUNNER / "runner.env").read_text()
    for name in re.findall(r"^([A-Z_]+)=", env, re.M):
        # Per machine, not per image: a pod has one GPU and a /tmp of its own.
        per_machine = (
            "CUDA_VISIBLE_DEVICES",
            "CUDA_DEVICE_ORDER",
            "LANG",
            "FLASHMOE_RUNNER_ALLOWED_WORKFLOW",
            "TMPDIR",
            "TORCHINDUCTOR_CACHE_DIR",
            "TRITON_CACHE_DIR",
        )
        if name not in per_machine:
            assert f"{name}=" in DOCKERFILE, f"the image sets no {name} (runner.env does)"


@pytest.mark.parametrize("path", VALUES, ids=lambda p: p.name)
def test_scale_set_values_pass_the_charts_rules(path):
    values = yaml.safe_load(path.read_text())
    assert set(values) <= TOP_LEVEL, set(values) - TOP_LEVEL
    assert re.fullmatch(r"https://github\.com/[\w.-]+/flashmoe-science", values["githubConfigUrl"])
    assert isinstance(values["githubConfigSecret"], str), "a pre-created secret, never a token here"
    assert 0 <= values["minRunners"] <= values["maxRunners"]
    assert len(values["runnerScaleSetName"]) <= 45
    assert values["runnerGroup"] == "gpu"
    assert values["containerMode"] == {}, "the runner container itself holds the GPU"


@pytest.mark.parametrize("path", VALUES, ids=lambda p: p.name)
def test_scale_set_pods_get_one_gpu_the_image_and_the_hook(path):
    values = yaml.safe_load(path.read_text())
    spec = values["template"]["spec"]
    runner = spec["containers"][0]
    assert runner["name"] == "runner" and runner["command"] == ["/home/runner/run.sh"]
    assert re.fullmatch(
        r"ghcr\.io/[\w.-]+/flashmoe-runner:2\.14\.1-cu130(@sha256:[0-9a-f]{64})?", runner["image"]
    )
    assert runner["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert runner["resources"]["requests"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e["value"] for e in runner["env"]}
    assert env["ACTIONS_RUNNER_HOOK_JOB_STARTED"] == "/opt/flashmoe/bin/cleanup-hook.sh"
    assert env["FLASHMOE_RUNNER_ALLOWED_WORKFLOW"].endswith(
        "/.github/workflows/gpu-ci.yml@refs/heads/main"
    )
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert runner["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]


def test_each_gpu_kind_has_a_pool_that_differs_only_where_the_card_does():
    from flashmoe_science.pipeline import gpukinds

    pools = {
        kind: yaml.safe_load((RUNNER / "arc" / f"values-{kind}.yaml").read_text())
        for kind in gpukinds.KINDS
    }
    for kind, values in pools.items():
        assert values["scaleSetLabels"] == ["gpu", kind]
        assert values["runnerScaleSetName"] == f"flashmoe-{kind}"
    selectors = [str(v["template"]["spec"]["nodeSelector"]) for v in pools.values()]
    assert len(set(selectors)) == len(pools), "each kind on its own node pool"
    images = {v["template"]["spec"]["containers"][0]["image"] for v in pools.values()}
    assert len(images) == 1, "one runner image for every kind"


RUNNER_LABEL = {"flashmoe-science/runner": "gpu"}
POLICY = RUNNER / "arc" / "networkpolicy.yaml"


@pytest.mark.parametrize("path", VALUES, ids=lambda p: p.name)
def test_scale_set_pods_hold_no_service_account_token_and_carry_the_policys_label(path):
    """A GPU job runs PR code in the pod: it gets no Kubernetes credential (the chart would mount
    its no-permission account's token), and the label the egress policy selects it by."""
    template = yaml.safe_load(path.read_text())["template"]
    assert template["spec"]["automountServiceAccountToken"] is False
    assert template["metadata"]["labels"] == RUNNER_LABEL


def egress_allows(policy: dict, address: str, port: int) -> bool:
    """Whether an ipBlock egress rule of the policy lets a pod reach address:port (TCP)."""
    ip = ipaddress.ip_address(address)
    for rule in policy["spec"]["egress"]:
        ports = [p["port"] for p in rule.get("ports", []) if p.get("protocol", "TCP") == "TCP"]
        if rule.get("ports") and port not in ports:
            continue
        for peer in rule.get("to", []):
            block = peer.get("ipBlock")
            if block is None or ipaddress.ip_network(block["cidr"]).version != ip.version:
                continue
            excepted = [
                ipaddress.ip_network(e)
                for e in block.get("except", [])
                if not e.startswith("API_SERVER_IP")
            ]
            if ip in ipaddress.ip_network(block["cidr"]) and not any(ip in e for e in excepted):
                return True
    return False


def test_the_network_policy_fences_the_runner_pods():
    """Egress of the runner pods: DNS, and HTTPS to public addresses. Never the metadata server
    (the node's cloud credentials), the cluster's API server (its service address, a private
    control plane, or the public one the placeholder names), or private networks; no ingress."""
    policy = yaml.safe_load(POLICY.read_text())
    assert policy["kind"] == "NetworkPolicy" and policy["apiVersion"] == "networking.k8s.io/v1"
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": RUNNER_LABEL}
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"} and spec["ingress"] == []
    for blocked in (
        "169.254.169.254",  # the metadata server (GCE, EC2, Azure)
        "fd00:ec2::254",  # EC2's IPv6 one
        "10.96.0.1",  # the `kubernetes` service (kubeadm's default range)
        "172.16.0.2",  # a private control plane (GKE)
        "192.168.1.10",
        "100.64.0.1",
    ):
        for port in (443, 6443, 80):
            assert not egress_allows(policy, blocked, port), (blocked, port)
    assert egress_allows(policy, "140.82.112.3", 443), "github.com over HTTPS"
    assert not egress_allows(policy, "140.82.112.3", 22), "HTTPS only"
    excepts = [
        e
        for r in spec["egress"]
        for p in r.get("to", [])
        for e in (p.get("ipBlock") or {}).get("except", [])
    ]
    assert "API_SERVER_IP/32" in excepts, "the public API server's address is to be filled in"
    dns = [r for r in spec["egress"] if not any("ipBlock" in p for p in r["to"])]
    assert dns and all(p["port"] == 53 for r in dns for p in r["ports"])


def test_settings_and_the_arc_readme_name_the_policy_and_the_token():
    settings = (RUNNER / "SETTINGS.md").read_text()
    readme = (RUNNER / "arc" / "README.md").read_text()
    for text in (settings, readme):
        assert "networkpolicy.yaml" in text and "automountServiceAccountToken: false" in text
        assert "169.254.169.254" in text and "API_SERVER_IP" in text
