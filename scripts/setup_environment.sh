#!/usr/bin/env bash
# Create or update the project's virtual environment, then validate it.
# Run with --help for the options. A second run checks what is installed and reinstalls nothing.
set -Eeuo pipefail

readonly STEPS=6
readonly DEFAULT_TORCH_CUDA="torch==2.14.1" # the CUDA 13.0 build
readonly DEFAULT_TORCH_CPU="torch==2.13.0"  # a CPU build on the project's machines (see --torch-index-url)
# Where Linux CPU builds of torch live (PyPI's Linux torch is the CUDA build); used alone, not beside
# PyPI, for a CPU build when --torch-index-url is not given.
readonly CPU_TORCH_INDEX="https://download.pytorch.org/whl/cpu"
# The .pth file that makes another interpreter's torch visible in the venv. While this variable is
# set it adds nothing, so pip and the requirement check see only what the venv itself holds.
readonly REUSE_PTH="_flashmoe_reuse_torch.pth"
readonly ISOLATE_VAR="FLASHMOE_SETUP_ISOLATE"
# Set to 1 for the same as --no-install (a machine with no package index: see --help).
readonly NO_INSTALL_VAR="FLASHMOE_SETUP_NO_INSTALL"
# The Python tools that get a launcher in the venv's bin/ under --no-install: command=module.
readonly LAUNCHERS=(nox=nox pytest=pytest pre-commit=pre_commit)

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPT_PATH="$REPO_ROOT/scripts/$(basename "${BASH_SOURCE[0]}")"
readonly REPO_ROOT SCRIPT_PATH

usage() {
  cat <<EOF
Usage: scripts/setup_environment.sh [OPTIONS]

Create or update the project's virtual environment: torch, the tools (nox, pytest, pytest-xdist,
ninja, pre-commit: the "dev" dependency group of pyproject.toml), numpy and flashmoe-science itself
(editable, installed without dependencies so it never replaces torch). Then install the pre-commit
hooks and run the environment check, \`python -m flashmoe_science env\`.

A second run is fast: it checks what is installed and installs only what is missing.

torch is installed only when the venv cannot import one already. A torch that the interpreter
(--python, or python3 on PATH) already holds is reused, as with --system-site-packages, so a GPU
runner that provisions a CUDA torch once never downloads it again. Before installing one, it checks
that the venv's disk has room: about 6.5 GB for the CUDA build, 1.3 GB for the CPU build.

Options:
  --venv DIR             The virtual environment to create or update (default: .venv in the repo
                         root, $REPO_ROOT/.venv).
  --python PATH          The interpreter to create the venv from (default: python3 on PATH). If it
                         imports torch, the venv reuses that torch and everything installed beside
                         it (packages the venv installs itself come first); it may be a venv's python.
  --torch SPEC           The pip requirement for torch when one must be installed
                         (default: $DEFAULT_TORCH_CUDA, the CUDA 13.0 build; on a machine with
                         neither an NVIDIA GPU (nvidia-smi) nor nvcc, the CPU build, as --cpu).
  --cpu                  Install a CPU build of torch instead ($DEFAULT_TORCH_CPU from
                         $CPU_TORCH_INDEX; about a tenth of the download). Ignored when torch
                         is reused or given by --torch.
  --cuda                 Install the CUDA build even on a machine with no NVIDIA GPU and no nvcc.
  --torch-index-url URL  An extra package index to find torch on, e.g.
                         https://download.pytorch.org/whl/cpu for CPU builds where the project's
                         wheel folder is not configured.
  --require-gpu          Passed to the environment check: fail unless a CUDA GPU is usable.
  --no-hooks             Do not install the git pre-commit hooks.
  --no-check             Do not run the environment check (step 6): for a CI job whose next step
                         runs it as its own stage (\`nox -s env\`), which records it.
  --no-install           Install nothing (a machine with no package index; $NO_INSTALL_VAR=1
                         does the same): torch and the tools must be importable already, from
                         --python's interpreter or PYTHONPATH. A missing tool is reported, not
                         installed; flashmoe-science is installed (editable) only if that works
                         offline, else imported from the checkout; the venv's bin/ gets launchers
                         for the tools it lacks (nox, pytest, pre-commit) that run them with the
                         venv's python, and a link to the ninja binary.
  -h, --help             Show this help and exit.

Files it keeps in the venv: .flashmoe-setup.stamp (the editable install is current for this
pyproject.toml), and $REUSE_PTH in site-packages when torch is reused (it adds
nothing while $ISOLATE_VAR=1, which is how this script installs into the venv alone).
Exit status: 0, 2 for a wrong option, else that of the failing step (the environment check's own
code when it is the check that fails: 255 for a broken environment).
EOF
}

# ---- output, timing and failure reporting ----

STEP_NO=0
STEP_TITLE=""
STEP_HINT=""
STEP_START=0
RUN_START=0

now_ms() {
  local t="${EPOCHREALTIME:-}"
  if [[ -n "$t" ]]; then
    t="${t//[.,]/}"
    echo $((10#$t / 1000))
  else
    echo $((SECONDS * 1000))
  fi
}

elapsed() { # elapsed START_MS -> "12.3 s"
  local ms=$(($(now_ms) - $1))
  printf '%d.%d s' $((ms / 1000)) $((ms % 1000 / 100))
}

step() { # step TITLE HINT: start the next step; HINT says what to do if it fails
  STEP_NO=$((STEP_NO + 1))
  STEP_TITLE="$1"
  STEP_HINT="$2"
  STEP_START=$(now_ms)
  echo "[$STEP_NO/$STEPS] $STEP_TITLE ..."
}

step_done() {
  echo "[$STEP_NO/$STEPS] $STEP_TITLE ... done in $(elapsed "$STEP_START")"
}

info() { echo "      $*"; }

die() { # die WHAT NEXT: fail the current step, saying what went wrong and what to do next
  if ((STEP_NO)); then
    echo "error: step [$STEP_NO/$STEPS] $STEP_TITLE failed: $1" >&2
  else
    echo "error: $1" >&2
  fi
  echo "next: $2" >&2
  exit 1
}

on_error() {
  local rc=$1
  # Subshells inherit the trap (set -E); report once, from the main shell.
  [[ "$BASHPID" == "$$" ]] || exit "$rc"
  if ((STEP_NO == 0)); then
    echo "error: setup failed before its first step (exit $rc)." >&2
  else
    echo "error: step [$STEP_NO/$STEPS] $STEP_TITLE failed (exit $rc) after $(elapsed "$STEP_START")." >&2
    echo "next: $STEP_HINT" >&2
  fi
  exit "$rc"
}
trap 'on_error $?' ERR

# ---- options ----

VENV="$REPO_ROOT/.venv"
PYTHON=""
PYTHON_GIVEN=0
TORCH_SPEC=""
TORCH_CHOSEN=0
CPU=0
WANT_CUDA=0
TORCH_INDEX_URL=""
REQUIRE_GPU=0
HOOKS=1
ENV_CHECK=1
NO_INSTALL=0
case "${!NO_INSTALL_VAR:-}" in "" | 0) ;; *) NO_INSTALL=1 ;; esac

usage_error() { echo "error: $1" >&2; echo "next: see --help" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || usage_error "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv) need_value "$@"; VENV="$2"; shift 2 ;;
    --python) need_value "$@"; PYTHON="$2"; PYTHON_GIVEN=1; shift 2 ;;
    --torch) need_value "$@"; TORCH_SPEC="$2"; TORCH_CHOSEN=1; shift 2 ;;
    --cpu) CPU=1; TORCH_CHOSEN=1; shift ;;
    --cuda) WANT_CUDA=1; TORCH_CHOSEN=1; shift ;;
    --torch-index-url) need_value "$@"; TORCH_INDEX_URL="$2"; shift 2 ;;
    --require-gpu) REQUIRE_GPU=1; shift ;;
    --no-hooks) HOOKS=0; shift ;;
    --no-check) ENV_CHECK=0; shift ;;
    --no-install) NO_INSTALL=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage_error "unknown option '$1'" ;;
  esac
done

[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
VENV_PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

((!CPU || !WANT_CUDA)) || usage_error "--cpu and --cuda exclude each other"

# nvcc on PATH or in CUDA_HOME: a machine that compiles the CUDA unit without a GPU (CI) needs the
# CUDA torch; one with neither a GPU nor nvcc can only run the CPU build.
cuda_machine() {
  command -v nvidia-smi >/dev/null || command -v nvcc >/dev/null ||
    [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]
}

if [[ -n "$TORCH_SPEC" ]]; then
  TORCH_WHY="given by --torch"
elif ((CPU)); then
  TORCH_SPEC="$DEFAULT_TORCH_CPU"
  TORCH_WHY="a CPU build, because --cpu was given"
elif ((!WANT_CUDA)) && ! cuda_machine; then
  CPU=1
  TORCH_SPEC="$DEFAULT_TORCH_CPU"
  TORCH_WHY="a CPU build: this machine has no NVIDIA GPU (no nvidia-smi) and no nvcc; --cuda installs the CUDA build instead"
else
  TORCH_SPEC="$DEFAULT_TORCH_CUDA"
  TORCH_WHY="the CUDA 13.0 build, the default (--cpu picks a smaller CPU build)"
fi
# Which index pip takes torch from: --torch-index-url beside the configured ones, or for a CPU
# build the CPU index alone (the configured find-links still count).
TORCH_INDEX=()
if [[ -n "$TORCH_INDEX_URL" ]]; then
  TORCH_INDEX=(--extra-index-url "$TORCH_INDEX_URL")
elif ((CPU)); then
  TORCH_INDEX=(--index-url "$CPU_TORCH_INDEX")
fi

RUN_START=$(now_ms)
echo "Setting up $VENV for $REPO_ROOT"

# ---- 1. the interpreter ----

step "Checking the Python interpreter" \
  "pass --python PATH pointing at Python >= the project's requires-python (pyproject.toml)"

if [[ -z "$PYTHON" ]]; then
  PYTHON="$(command -v python3 || command -v python || true)"
  [[ -n "$PYTHON" ]] || die "no python3 on PATH" "install Python >= 3.10, or pass --python PATH"
elif [[ "$PYTHON" != */* ]]; then
  PYTHON="$(command -v "$PYTHON" || true)"
  [[ -n "$PYTHON" ]] || die "--python: no such command on PATH" "pass the interpreter's full path"
fi
[[ -x "$PYTHON" ]] || die "--python $PYTHON is not an executable" "pass the interpreter's full path"
[[ "$PYTHON" == /* ]] || PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"

# requires-python is read from pyproject.toml (a plain ">=X.Y" is all this script understands).
MIN_PY="$(sed -n 's/^requires-python *= *">= *\([0-9]*\.[0-9]*\)".*/\1/p' "$REPO_ROOT/pyproject.toml")"
PY_VERSION="$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
if [[ -n "$MIN_PY" ]]; then
  "$PYTHON" -c "import sys; sys.exit(sys.version_info[:2] < tuple(map(int, '$MIN_PY'.split('.'))))" ||
    die "$PYTHON is Python $PY_VERSION; the project needs >= $MIN_PY" "pass --python PATH to a newer interpreter"
fi
info "interpreter: $PYTHON (Python $PY_VERSION)"
step_done

# ---- 2. the virtual environment ----

step "Creating the virtual environment" \
  "check that '$PYTHON -m venv' works (Debian: apt-get install python3-venv), or remove $VENV and rerun"

if [[ -x "$VENV_PY" ]]; then
  "$VENV_PY" -c 'pass' || die "$VENV exists but its python does not run" "remove $VENV and rerun"
  info "$VENV exists; reusing it"
else
  [[ ! -e "$VENV" || -z "$(ls -A "$VENV")" ]] ||
    die "$VENV exists but is not a virtual environment" "remove it, or pick another --venv"
  if ((NO_INSTALL)); then
    # No pip of its own (ensurepip takes ~4 CPU-seconds, and a GPU job makes this venv every run):
    # the reused interpreter's pip runs the offline editable install; see ensure_pip.
    "$PYTHON" -m venv --without-pip "$VENV"
    info "created $VENV (without pip of its own: --no-install)"
  else
    "$PYTHON" -m venv "$VENV"
    info "created $VENV"
  fi
fi
VENV_PY_VERSION="$("$VENV_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
VENV_SITE="$("$VENV_PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
step_done

# ensure_pip [isolated]: the venv runs a pip (isolated: without the reused interpreter's, as the
# installs below run it), else it gets one of its own from ensurepip's bundled wheel, offline. A
# venv made under --no-install has none: a later run that installs adds it here.
ensure_pip() {
  local isolate="${1:-}"
  env ${isolate:+"$ISOLATE_VAR=1"} "$VENV_PY" -c 'import pip' 2>/dev/null && return 0
  info "the venv has no pip to run: adding its own (ensurepip, offline)"
  env "$ISOLATE_VAR=1" "$VENV_PY" -I -m ensurepip --default-pip >/dev/null
}

# ---- 3. torch ----

OR_CPU=", or pass --cpu"
((!CPU)) || OR_CPU=""
step "Installing torch" \
  "read pip's error above: if it could not find '$TORCH_SPEC', pass${OR_CPU:+ --cpu,} another --torch SPEC or --torch-index-url URL; if it ran out of disk space, free some on the disk that holds $VENV, or pass --venv DIR on another disk$OR_CPU"

# torch_version [isolated]: the torch version the venv sees, or nothing. Reads metadata only,
# which is fast; the environment check (step 6) imports it.
torch_version() {
  local isolate="${1:-}"
  env ${isolate:+"$ISOLATE_VAR=1"} "$VENV_PY" -I -c '
import importlib.metadata as md
try:
    print(md.version("torch"))
except md.PackageNotFoundError:
    pass'
}

# Another interpreter's torch: its version, CUDA version, and the site directories to share.
probe_torch() { # probe_torch PYTHON
  (cd / && "$1" - <<'EOF'
import os, sys
dirs = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
try:
    import torch
except Exception as exc:  # a torch that does not import is no torch to reuse
    print(f"error={type(exc).__name__}: {exc}".splitlines()[0])
else:
    location = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    if location not in dirs:
        dirs.append(location)
    print(f"torch={torch.__version__}")
    print(f"cuda={torch.version.cuda or 'none (CPU build)'}")
    print(f"location={location}")
    print("dirs=" + os.pathsep.join(dirs))
print("python=%d.%d" % sys.version_info[:2])
EOF
  )
}

# What the venv grows by with torch and the tools, in MiB (measured: 5,789 MiB with the CUDA 13.0
# build, its nvidia-* libraries 3.2 GiB of it; about 1 GiB with the CPU build), and some room for
# pip's temporary files. A disk that cannot hold it fails here, before pip fills it.
readonly NEED_MB_CUDA=6500 NEED_MB_CPU=1300
check_free_space() {
  local need=$NEED_MB_CUDA build="the CUDA build" free_kb
  ((!CPU)) || { need=$NEED_MB_CPU; build="the CPU build"; }
  free_kb="$(df -Pk "$VENV" 2>/dev/null | sed -n '2{s/^[^ ]* *[0-9]* *[0-9]* *\([0-9]*\).*/\1/p;}' || true)"
  [[ "$free_kb" =~ ^[0-9]+$ ]] || return 0  # no df, or an output it cannot read: pip will tell
  ((free_kb / 1024 < need)) || return 0
  local next="free some on that disk, or pass --venv DIR on a disk with more"
  ((CPU)) || next+="$OR_CPU (about $NEED_MB_CPU MiB; \`nox -s compile\` links against the CUDA build and cannot run beside it)"
  die "$((free_kb / 1024)) MiB free on the disk that holds $VENV; $TORCH_SPEC ($build) with the tools needs about $need MiB" "$next"
}

OWN_TORCH="$(torch_version isolated)"
SEEN_TORCH="$(torch_version)"
if [[ -n "$OWN_TORCH" ]]; then
  info "torch $OWN_TORCH is already installed in the venv; not installing torch"
  WANTED="${TORCH_SPEC#torch==}"
  if ((TORCH_CHOSEN)) && [[ "$OWN_TORCH" != "$WANTED" && "$OWN_TORCH" != "$WANTED+"* ]]; then
    info "(not $TORCH_SPEC: --torch and --cpu apply only where torch is missing; recreate the venv to switch)"
  fi
elif [[ -n "$SEEN_TORCH" ]]; then
  info "torch $SEEN_TORCH is reused from another interpreter (see $VENV_SITE/$REUSE_PTH); not installing torch"
else
  PROBE_OUT="$(probe_torch "$PYTHON")"
  declare -A PROBE=()
  while IFS='=' read -r key value; do PROBE[$key]="$value"; done <<<"$PROBE_OUT"
  if [[ -n "${PROBE[torch]:-}" && "${PROBE[python]}" != "$VENV_PY_VERSION" ]]; then
    # Sharing site-packages across Python versions would load extension modules of another ABI.
    info "$PYTHON has torch ${PROBE[torch]}, but for Python ${PROBE[python]}, not the venv's $VENV_PY_VERSION"
    ((!PYTHON_GIVEN)) ||
      die "cannot reuse that torch in $VENV" "remove $VENV so that it is recreated from $PYTHON"
    PROBE[torch]=""
  fi
  if [[ -n "${PROBE[torch]:-}" ]]; then
    info "$PYTHON imports torch ${PROBE[torch]} (CUDA ${PROBE[cuda]}) from ${PROBE[location]}"
    info "reusing it, not installing torch: $REUSE_PTH adds that interpreter's site-packages"
    "$VENV_PY" -I - "$VENV_SITE/$REUSE_PTH" "$PYTHON" "${PROBE[dirs]}" "$ISOLATE_VAR" <<'EOF'
import os, sys
path, python, dirs, isolate = sys.argv[1], sys.argv[2], sys.argv[3].split(os.pathsep), sys.argv[4]
with open(path, "w") as f:
    f.write(f"# Written by scripts/setup_environment.sh: reuse the torch of {python}.\n")
    f.write(f"# The venv's own packages come first; while {isolate} is set, this adds nothing.\n")
    # site runs this line with exec() inside a function: the comprehension sees builtins, not `site`.
    f.write(f"import os; os.environ.get({isolate!r}) or [__import__('site').addsitedir(p) for p in {dirs!r}]\n")
EOF
    SEEN_TORCH="$(torch_version)"
    [[ -n "$SEEN_TORCH" ]] ||
      die "the venv sees no torch even with $VENV_SITE/$REUSE_PTH" "remove that file and pass --python to an interpreter that imports torch"
  else
    [[ -z "${PROBE[error]:-}" ]] || info "$PYTHON does not import torch (${PROBE[error]})"
    ((!NO_INSTALL)) ||
      die "no torch to reuse, and --no-install ($NO_INSTALL_VAR) forbids installing one" \
        "pass --python PATH to an interpreter that imports torch"
    info "installing $TORCH_SPEC${TORCH_INDEX[1]:+ (index ${TORCH_INDEX[1]})}: $TORCH_WHY"
    if ((!CPU)) && ! command -v nvidia-smi >/dev/null; then
      info "(no NVIDIA driver here, no nvidia-smi: --cpu would install a much smaller build)"
    fi
    check_free_space
    ensure_pip isolated
    # Isolated, pip sees only the venv and installs into it alone.
    env "$ISOLATE_VAR=1" "$VENV_PY" -m pip install "${TORCH_INDEX[@]}" "$TORCH_SPEC"
    TORCH_CUDA="$("$VENV_PY" -W ignore -c 'import torch; print(torch.version.cuda or "")')"  # numpy comes in step 4
    if [[ -z "$TORCH_CUDA" ]]; then
      info "installed torch $(torch_version) (CPU build)"
    else
      info "installed torch $(torch_version) (CUDA $TORCH_CUDA)"
      ((!CPU)) || info "warning: --cpu was given but pip chose a CUDA build: try --torch-index-url https://download.pytorch.org/whl/cpu"
    fi
  fi
fi
step_done

# ---- 4. the tools and the package ----

step "Installing the tools and flashmoe-science (editable)" \
  "read pip's message above; a rerun installs only what is still missing"

# The stamp (in the venv, so keyed by --venv) says the editable install is current for this
# pyproject.toml, this script and this checkout. The torch options do not enter it: step 3 checks
# torch itself. The requirements are checked on every run, which is fast.
OPTIONS="repo=$REPO_ROOT"
STAMP="$VENV/.flashmoe-setup.stamp"
if ((NO_INSTALL)); then
  # What the venv can import counts: the reused interpreter's packages and PYTHONPATH included.
  CHECK_PY=("$VENV_PY")
  ensure_pip  # the check below reads requirements with pip's packaging where none is installed
else
  CHECK_PY=(env "$ISOLATE_VAR=1" "$VENV_PY" -I)
  ensure_pip isolated
fi
CHECK_OUT="$("${CHECK_PY[@]}" - "$REPO_ROOT" "$SCRIPT_PATH" "$OPTIONS" <<'EOF'
"""Print key=<stamp key>, editable=yes|no, then one wanted requirement per line that is missing."""
import hashlib, importlib.metadata as md, json, pathlib, sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ModuleNotFoundError:  # a fresh venv: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

repo, script, options = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
pyproject = (repo / "pyproject.toml").read_bytes()
data = tomllib.loads(pyproject.decode())
key = hashlib.sha256(pyproject + script.read_bytes() + options.encode()).hexdigest()
print(f"key={key}")

try:
    dist = md.distribution(data["project"]["name"])
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    editable = (
        dist.version == data["project"]["version"]
        and url.get("dir_info", {}).get("editable", False)
        and url.get("url") == repo.as_uri()
    )
except md.PackageNotFoundError:
    editable = False
print(f"editable={'yes' if editable else 'no'}")

groups = data.get("dependency-groups", {})

def group(name):
    for item in groups.get(name, []):
        if isinstance(item, dict):
            yield from group(item["include-group"])
        else:
            yield item

# --no-build-isolation needs the build requirements in the venv itself.
wanted = [
    *data.get("build-system", {}).get("requires", []),
    *data["project"].get("dependencies", []),
    *group("dev"),
]
for text in dict.fromkeys(wanted):
    req = Requirement(text)
    if canonicalize_name(req.name) == "torch" or (req.marker and not req.marker.evaluate()):
        continue  # step 3 owns torch
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        print(text)
        continue
    if not req.specifier.contains(have, prereleases=True):
        print(text)
EOF
)"
mapfile -t CHECK <<<"$CHECK_OUT"
KEY="${CHECK[0]#key=}"
EDITABLE="${CHECK[1]#editable=}"
MISSING=("${CHECK[@]:2}")

# Everything is installed with the torch reuse file switched off, so the tools land in the venv
# itself (with their console scripts) and pip never touches the reused interpreter. (So a dev tool
# that depends on torch would make pip install one here: keep torch out of the dependency groups.)
if ((${#MISSING[@]} && NO_INSTALL)); then
  info "warning: not installing (--no-install): ${MISSING[*]}; what needs them will fail"
elif ((${#MISSING[@]})); then
  info "installing: ${MISSING[*]}"
  env "$ISOLATE_VAR=1" "$VENV_PY" -m pip install -q "${MISSING[@]}"
else
  info "tools: all requirements of pyproject.toml (build-system, dependencies, dev group) are installed"
fi
if [[ "$EDITABLE" == yes && -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
  info "flashmoe-science: editable install is current (stamp $STAMP)"
elif ((NO_INSTALL)); then
  # Offline, with whatever setuptools the venv imports (the reused interpreter's, say).
  PIP_LOG="$VENV/.flashmoe-setup-pip.log"
  if "$VENV_PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$REPO_ROOT" >"$PIP_LOG" 2>&1; then
    info "installed flashmoe-science from $REPO_ROOT (editable, offline)"
    echo "$KEY" >"$STAMP"
  else
    info "warning: flashmoe-science could not be installed offline ($PIP_LOG): it is imported from"
    info "the checkout, where nox runs its sessions"
  fi
else
  info "installing flashmoe-science from $REPO_ROOT (editable, no dependencies, no build isolation)"
  env "$ISOLATE_VAR=1" "$VENV_PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO_ROOT"
  echo "$KEY" >"$STAMP"
fi
if ((NO_INSTALL)); then
  # Launchers for the tools the venv imports but has no command for (they may live on PYTHONPATH,
  # whose console scripts name another interpreter): each runs its tool with the venv's python.
  LAUNCHED=()
  for item in "${LAUNCHERS[@]}"; do
    cmd="${item%%=*}" module="${item#*=}"
    if [[ -e "$VENV/bin/$cmd" ]] ||
      ! "$VENV_PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
      continue
    fi
    printf '#!/bin/sh\n# Written by scripts/setup_environment.sh --no-install.\nexec "%s" -m %s "$@"\n' \
      "$VENV_PY" "$module" >"$VENV/bin/$cmd"
    chmod +x "$VENV/bin/$cmd"
    LAUNCHED+=("$cmd")
  done
  # ninja is a binary, not a script (and `python -m ninja` looks for it in the venv's bin/): link
  # the one beside the reused interpreter, or the one installed with the ninja module it imports.
  if [[ ! -e "$VENV/bin/ninja" ]]; then
    NINJA="$("$VENV_PY" - "$PYTHON" <<'EOF'
import importlib.util, os, sys
spec = importlib.util.find_spec("ninja")
site = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else ""
found = [os.path.join(os.path.dirname(sys.argv[1]), "ninja")]
if site:  # pip --target (site/bin/) and venv (lib/pythonX.Y/site-packages -> bin/) layouts
    found += [os.path.join(site, "bin", "ninja"), os.path.join(site, "..", "..", "..", "bin", "ninja")]
print(next((os.path.abspath(p) for p in found if os.path.isfile(p) and os.access(p, os.X_OK)), ""))
EOF
    )"
    if [[ -n "$NINJA" ]]; then
      ln -s "$NINJA" "$VENV/bin/ninja"
      LAUNCHED+=("ninja (-> $NINJA)")
    fi
  fi
  ((${#LAUNCHED[@]} == 0)) || info "launchers in $VENV/bin that use the venv's python: ${LAUNCHED[*]}"
fi
step_done

# ---- 5. the pre-commit hooks ----

step "Installing the pre-commit hooks" \
  "rerun with --no-hooks to skip them, or run '$VENV_PY -m pre_commit install' to see the full error"

if ((!HOOKS)); then
  info "skipped (--no-hooks)"
elif ! command -v git >/dev/null || ! git -C "$REPO_ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  info "skipped: $REPO_ROOT is not a git checkout"
elif [[ ! -f "$REPO_ROOT/.pre-commit-config.yaml" ]]; then
  info "skipped: $REPO_ROOT has no .pre-commit-config.yaml"
elif [[ -n "$(git -C "$REPO_ROOT" config --get core.hooksPath || true)" ]]; then
  info "skipped: git's core.hooksPath is set, and pre-commit does not install hooks then"
  info "(to use them: git config --unset-all core.hooksPath, then rerun)"
else
  HOOK="$(git -C "$REPO_ROOT" rev-parse --git-path hooks)/pre-commit"
  [[ "$HOOK" == /* ]] || HOOK="$REPO_ROOT/$HOOK"
  if [[ -f "$HOOK" ]] && grep -qF "INSTALL_PYTHON=$VENV_PY" "$HOOK"; then
    info "already installed: $HOOK runs pre-commit from this venv"
  else
    (cd "$REPO_ROOT" && "$VENV_PY" -m pre_commit install)
  fi
fi
step_done

# ---- 6. validation ----

HINT="fix what the message above reports, then rerun this script (finished steps are skipped)"
((!REQUIRE_GPU)) || HINT="$HINT; on a machine without a GPU, drop --require-gpu"
step "Validating the environment (python -m flashmoe_science env)" "$HINT"
ENV_ARGS=()
if ((REQUIRE_GPU)); then ENV_ARGS+=(--require-gpu); fi
if ((!ENV_CHECK)); then
  info "skipped (--no-check: the job's own env stage runs it)"
else
  # With the venv's bin/ first on PATH, as when it is activated: the check finds the venv's ninja.
  PATH="$VENV/bin:$PATH" "$VENV_PY" -m flashmoe_science env "${ENV_ARGS[@]}"
fi
step_done

echo "Environment ready in $(elapsed "$RUN_START"): activate it with 'source $VENV/bin/activate'."
