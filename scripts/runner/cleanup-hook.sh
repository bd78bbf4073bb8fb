#!/usr/bin/env bash
# The GPU runner's job-started hook (ACTIONS_RUNNER_HOOK_JOB_STARTED in the runner's .env): removes
# what an earlier job, a pull request's included, left for this one. See --help.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: cleanup-hook.sh [--dry-run] [--work-dir DIR] [--allow-root]

Runs as the runner's user before each job (the runner calls it; install a root-owned copy outside
the runner's directories, never the checkout's: the checkout is what a pull request wrote) and
removes what an earlier job could leave for the next one:

  workspace  everything under the runner's work directory (FLASHMOE_RUNNER_WORK_DIR, the
             runner's _work) except _actions, _temp and _PipelineMapping, which the runner has
             just prepared for this job: the old checkout with its .git (hooks, config,
             worktree records) and build/ (the base worktrees of `bench --base`) goes whole,
             so nothing of it is reused. The current job's $GITHUB_WORKSPACE is recreated empty.
  caches     in $HOME, what a job could seed for the next: ~/.triton, ~/.cache/pip,
             ~/.cache/torch_extensions, ~/.cache/torch/kernels, ~/.cache/flashmoe-science,
             ~/.nv/ComputeCache (the CUDA JIT cache), and configuration that would run or
             fetch code: ~/.gitconfig, ~/.config/git, ~/.config/pip, ~/.pip, ~/.pydistutils.cfg,
             ~/.local/lib/python* (user site-packages: sitecustomize, .pth files).
  GPU        compute processes on any GPU (nvidia-smi) owned by this user: stopped (TERM, then
             KILL after 5 s). Another user's process on this runner's GPUs (CUDA_VISIBLE_DEVICES)
             is left alone and fails the hook: the job's timings would be wrong. No nvidia-smi,
             or one that fails: skipped, with a line.
  interpreter  FLASHMOE_RUNNER_PYTHON's installation must not be writable by this user (a job
             could plant a sitecustomize.py there): fails the hook if it is (not checked as root).
  workflow   with FLASHMOE_RUNNER_ALLOWED_WORKFLOW set (comma-separated OWNER/REPO/.github/
             workflows/FILE@REF), fails the hook unless the job's GITHUB_WORKFLOW_REF is one of
             them: a pull request's own workflow (ref refs/pull/N/merge) never runs here, where a
             runner group restricted to the workflow is not available (personal repositories).

It never follows a symbolic link out of the directory it cleans, and deletes nothing outside the
work directory and the paths above. A symbolic link among the folders on the way to a path above
(~/.config, ~/.cache, ~/.local linked elsewhere) fails the hook: an earlier job left it so that later
jobs read its configuration (a git config whose core.fsmonitor runs on `git status`). Each action
is printed.

Options:
  --dry-run      Print what would be removed or stopped; change nothing.
  --work-dir DIR The runner's work directory (default: $FLASHMOE_RUNNER_WORK_DIR); it must be
                 owned by this user and not be /, $HOME or a directory above $HOME.
  --allow-root   Run as root (refused otherwise: the runner's user is never root).
  -h, --help     Show this help.
Exit status: 0 done; 1 the job must not run (another user's GPU process, a writable interpreter,
an unsafe work directory, a workflow not allowed, a linked folder in $HOME); 2 a wrong option.
EOF
}

DRY=0
WORK="${FLASHMOE_RUNNER_WORK_DIR:-}"
ALLOW_ROOT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --work-dir) WORK="${2:?--work-dir needs a value}"; shift 2 ;;
    --allow-root) ALLOW_ROOT=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "cleanup-hook: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "cleanup-hook: $*"; }
PROBLEMS=0
problem() { # problem WHAT NEXT: the job must not run
  echo "cleanup-hook: error: $1" >&2
  echo "cleanup-hook: next: $2" >&2
  PROBLEMS=$((PROBLEMS + 1))
}
if ((DRY)); then say "dry run: nothing is changed"; fi

ME="$(id -u)"
if ((ME == 0 && !ALLOW_ROOT)); then
  echo "cleanup-hook: error: refusing to run as root (the runner's user never is)" >&2
  echo "cleanup-hook: next: run it as the runner's user, or pass --allow-root" >&2
  exit 1
fi

# ---- the workflow the job comes from ----

ALLOWED="${FLASHMOE_RUNNER_ALLOWED_WORKFLOW:-}"
if [[ -n "$ALLOWED" ]]; then
  ref="${GITHUB_WORKFLOW_REF:-}"
  allowed_ok=0
  IFS=',' read -r -a allowed_list <<<"$ALLOWED"
  for want in "${allowed_list[@]}"; do
    if [[ -n "$ref" && "$ref" == "$want" ]]; then allowed_ok=1; fi
  done
  shown="$(printf '%q' "${ref:-unset}")" # the ref names a file a pull request could add: quoted
  if ((allowed_ok)); then
    say "workflow: $shown is allowed here"
  else
    problem "workflow $shown is not one this runner serves (FLASHMOE_RUNNER_ALLOWED_WORKFLOW)" \
      "GPU jobs run from the allowed workflow on the default branch; a pull request's own workflow never does"
  fi
fi

# linked_on_the_way ROOT PATH: print the first symbolic link among the folders between ROOT and
# PATH (ROOT and PATH themselves left out); fails when there is none.
linked_on_the_way() {
  local here="$1" rest part parts=()
  rest="$(dirname -- "${2#"$1"/}")"
  [[ "$rest" != . ]] || return 1
  IFS=/ read -r -a parts <<<"$rest"
  for part in "${parts[@]}"; do
    here="$here/$part"
    if [[ -L "$here" ]]; then
      echo "$here"
      return 0
    fi
    [[ -d "$here" ]] || return 1 # nothing further down exists
  done
  return 1
}

# remove ROOT PATH: delete PATH (a file, a directory or a link) if it lies inside ROOT with no
# symbolic link on the way there. A link itself is removed, never followed. A linked folder on the
# way fails the hook, whether PATH exists or not: an earlier job put it there to redirect what later
# jobs read (~/.config -> a folder whose git/config sets core.fsmonitor runs code in the next job's
# `git status`), and skipping it would leave exactly that.
REMOVED=0
remove() {
  local root="$1" path="$2" parent link
  if link="$(linked_on_the_way "$root" "$path")"; then
    problem "$(printf '%q' "$path") is reached through the symbolic link $(printf '%q' "$link") (-> $(printf '%q' "$(readlink -- "$link")")): a job left it to redirect what later jobs read" \
      "do not run jobs here until the runner user's home is recreated (register.sh does it before each job): as root, rm -rf $(printf '%q' "$link") and rerun"
    return 0
  fi
  [[ -e "$path" || -L "$path" ]] || return 0
  parent="$(realpath -e -- "$(dirname -- "$path")" 2>/dev/null)" || return 0
  if [[ "$parent" != "$(dirname -- "$path")" || ("$parent" != "$root" && "$parent" != "$root"/*) ]]; then
    problem "$(printf '%q' "$path") resolves outside $root (to $(printf '%q' "$parent")): a symbolic link on the way" \
      "as root, remove the link on the way to $(printf '%q' "$path") and rerun"
    return 0
  fi
  if ((DRY)); then
    say "would remove $path"
  else
    # A job may have made its folders read-only. chmod -R ignores the links it meets inside; the
    # path itself is not a link here.
    [[ -L "$path" || ! -d "$path" ]] || chmod -R u+rwX -- "$path" 2>/dev/null || true
    if ! rm -rf --one-file-system -- "$path"; then
      problem "could not remove all of $path" "remove it as root, then rerun the job"
      return 0
    fi
    say "removed $path"
  fi
  REMOVED=$((REMOVED + 1))
}

# ---- the work directory ----

if [[ -z "$WORK" ]]; then
  say "workspace: no work directory given (FLASHMOE_RUNNER_WORK_DIR or --work-dir): skipped"
else
  home_real="$(realpath -m -- "${HOME:-/}")"
  work_real="$(realpath -e -- "$WORK" 2>/dev/null || true)"
  if [[ -z "$work_real" || ! -d "$work_real" ]]; then
    problem "work directory $WORK does not exist" \
      "set FLASHMOE_RUNNER_WORK_DIR in the runner's .env to the runner's _work directory"
  elif [[ -L "$WORK" || "$work_real" != "$(realpath -m -- "$WORK")" || "$WORK" != /* ]]; then
    problem "work directory $WORK is not an absolute path free of symbolic links" \
      "set FLASHMOE_RUNNER_WORK_DIR to the real path of the runner's _work directory"
  elif [[ "$work_real" == / || "$home_real" == "$work_real" || "$home_real" == "$work_real"/* ]]; then
    problem "work directory $work_real is / or holds \$HOME ($home_real): refusing to empty it" \
      "point FLASHMOE_RUNNER_WORK_DIR at the runner's _work directory"
  elif [[ "$(stat -c %u -- "$work_real")" != "$ME" ]]; then
    problem "work directory $work_real is not owned by $(id -un)" \
      "run the hook as the runner's user, or fix FLASHMOE_RUNNER_WORK_DIR"
  else
    say "workspace: emptying $work_real (keeping _actions, _temp, _PipelineMapping)"
    while IFS= read -r -d '' entry; do
      case "$(basename -- "$entry")" in
        _actions | _temp | _PipelineMapping) ;;
        *) remove "$work_real" "$entry" ;;
      esac
    done < <(find "$work_real" -mindepth 1 -maxdepth 1 -print0)
    ws="${GITHUB_WORKSPACE:-}"
    if ((!DRY)) && [[ -n "$ws" && "$ws" == "$work_real"/* && ! -e "$ws" ]]; then
      mkdir -p -- "$ws"
      say "recreated the job's workspace $ws (empty)"
    fi
  fi
fi

# ---- caches and configuration in $HOME ----

if [[ -z "${HOME:-}" || "$HOME" == / || ! -d "$HOME" ]]; then
  say "caches: no usable \$HOME (${HOME:-unset}): skipped"
else
  home="$(realpath -e -- "$HOME")"
  say "caches: cleaning $home"
  for rel in .triton .cache/pip .cache/torch_extensions .cache/torch/kernels .cache/flashmoe-science \
    .nv/ComputeCache .gitconfig .config/git .config/pip .pip .pydistutils.cfg; do
    remove "$home" "$home/$rel"
  done
  for site in "$home"/.local/lib/python*; do
    if [[ -e "$site" || -L "$site" ]]; then remove "$home" "$site"; fi
  done
fi

# ---- the interpreter the job reuses ----

py="${FLASHMOE_RUNNER_PYTHON:-}"
if [[ -z "$py" ]]; then
  say "interpreter: FLASHMOE_RUNNER_PYTHON not set: not checked"
elif ((ME == 0)); then
  say "interpreter: running as root, which may write anywhere: not checked"
elif [[ ! -x "$py" ]]; then
  problem "FLASHMOE_RUNNER_PYTHON=$py is not an executable" \
    "fix FLASHMOE_RUNNER_PYTHON in the runner's .env (scripts/runner/runner.env)"
else
  prefix="$(dirname -- "$(dirname -- "$py")")"
  # Links are left out: -writable judges a link by its target (a unit file linked to /dev/null).
  writable="$(find "$prefix" ! -type l -writable -print -quit 2>/dev/null || true)"
  if [[ -n "$writable" ]]; then
    problem "$(id -un) can write into $prefix ($writable): a job could plant code that the next job imports" \
      "make it read-only for the runner's user: chown -R root:root $prefix && chmod -R go-w $prefix"
  else
    say "interpreter: $prefix is read-only for $(id -un)"
  fi
fi

# ---- GPU processes ----

STOPPED=0
if ! command -v nvidia-smi >/dev/null; then
  say "gpu: no nvidia-smi on PATH: skipped"
elif ! apps="$(nvidia-smi --query-compute-apps=pid,gpu_uuid,process_name,used_memory \
  --format=csv,noheader,nounits 2>&1)"; then
  say "gpu: nvidia-smi failed ($(head -n1 <<<"$apps")): skipped"
else
  # This runner's GPUs: CUDA_VISIBLE_DEVICES as indices or UUIDs; unset means all of them.
  mine=()
  if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
    gpus="$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null || true)"
    IFS=',' read -r -a wanted <<<"$CUDA_VISIBLE_DEVICES"
    for want in "${wanted[@]}"; do
      want="${want// /}"
      while IFS=', ' read -r index uuid; do
        if [[ "$want" == "$index" || ("$want" == GPU-* && "$uuid" == "$want"*) ]]; then mine+=("$uuid"); fi
      done <<<"$gpus"
    done
  fi
  ancestors=" $$ "
  pid=$$
  while [[ "$pid" -gt 1 ]]; do # the runner's own processes, which started this hook
    pid="$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)"
    ancestors+="$pid "
  done
  found=0
  while IFS=',' read -r pid uuid name mem; do
    pid="${pid// /}" uuid="${uuid// /}" name="${name# }" mem="${mem// /}"
    [[ "$pid" =~ ^[0-9]+$ ]] || continue
    found=$((found + 1))
    if [[ ! -d "/proc/$pid" ]]; then
      say "gpu: pid $pid ($name) is not visible here (another PID namespace, or gone): left alone"
      continue
    fi
    owner="$(stat -c %u "/proc/$pid")"
    if [[ "$owner" == "$ME" && "$ancestors" != *" $pid "* ]]; then
      if ((DRY)); then
        say "gpu: would stop pid $pid ($name, $mem MiB on $uuid), a leftover of an earlier job"
        continue
      fi
      kill -TERM "$pid" 2>/dev/null || true
      for _ in 1 2 3 4 5 6 7 8 9 10; do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
      done
      kill -KILL "$pid" 2>/dev/null || true
      say "gpu: stopped pid $pid ($name, $mem MiB on $uuid), a leftover of an earlier job"
      STOPPED=$((STOPPED + 1))
      continue
    fi
    user="$(id -nu "$owner" 2>/dev/null || echo "uid $owner")"
    ours=1
    if ((${#mine[@]})); then
      ours=0
      for want in "${mine[@]}"; do
        if [[ "$uuid" == "$want" ]]; then ours=1; fi
      done
    fi
    if ((ours)); then
      problem "pid $pid ($name) of user $user uses $mem MiB on this runner's GPU $uuid" \
        "stop it, or give this runner a GPU of its own (CUDA_VISIBLE_DEVICES in its .env)"
    else
      say "gpu: pid $pid of user $user is on $uuid, not this runner's GPU: left alone"
    fi
  done <<<"$apps"
  ((found)) || say "gpu: no compute processes"
fi

if ((DRY)); then
  say "dry run done: $REMOVED path(s) would be removed"
else
  say "done: removed $REMOVED path(s), stopped $STOPPED GPU process(es)"
fi
if ((PROBLEMS)); then
  echo "cleanup-hook: $PROBLEMS problem(s): this job must not run on this runner as it is" >&2
  exit 1
fi
