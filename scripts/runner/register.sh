#!/usr/bin/env bash
# Set up and serve the self-hosted GPU runners of gpu-ci.yml: one ephemeral runner per GPU,
# re-registered before every job by a root-owned service that holds the credential. See --help.
set -euo pipefail

# The actions/runner release (https://github.com/actions/runner/releases) and the SHA-256 GitHub
# publishes for its Linux x64 archive. To upgrade: change both, from the release page.
readonly RUNNER_VERSION="2.337.0"
readonly RUNNER_SHA256_PINNED="70920811a4f8ad4328818682bca5c6469c1c942fab52448868071d0063816613"
readonly ARCHIVE="actions-runner-linux-x64-$RUNNER_VERSION.tar.gz"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
# Overridable for tests and GitHub Enterprise Server: where things are fetched and kept.
DOWNLOAD_URL="${FLASHMOE_RUNNER_DOWNLOAD_URL:-https://github.com/actions/runner/releases/download/v$RUNNER_VERSION/$ARCHIVE}"
RUNNER_SHA256="${FLASHMOE_RUNNER_SHA256:-$RUNNER_SHA256_PINNED}"
API_URL="${GITHUB_API_URL:-https://api.github.com}"
SERVER_URL="${GITHUB_SERVER_URL:-https://github.com}"
TOKEN_FILE="${FLASHMOE_RUNNER_TOKEN_FILE:-/etc/flashmoe-runner/github-token}"
CONF="${FLASHMOE_RUNNER_CONF:-/etc/flashmoe-runner/runner.conf}"
ROOT="${FLASHMOE_RUNNER_ROOT:-/opt/flashmoe-runner}"
CACHE="${FLASHMOE_RUNNER_CACHE:-/var/cache/flashmoe-runner}"
UNIT_DIR="${FLASHMOE_RUNNER_UNIT_DIR:-/etc/systemd/system}"
ETC="${FLASHMOE_RUNNER_ETC:-/etc}"                   # cron.allow, at.allow and their .deny
SKEL="${FLASHMOE_RUNNER_SKEL:-/etc/skel}"            # what a runner user's home is made from
SHARED_TMP="${FLASHMOE_RUNNER_SHARED_TMP:-/tmp /var/tmp /dev/shm}"
NVIDIA_PROC="${FLASHMOE_RUNNER_NVIDIA_PROC:-/proc/driver/nvidia/gpus}"

usage() {
  cat <<EOF
Usage: scripts/runner/register.sh [--dry-run] COMMAND [OPTIONS]

Commands (docs/runners.md, "Self-hosted runners: trust and set-up", walks through them):
  preflight  Check this machine for the GPU job: the driver and nvcc that torch's CUDA needs
             (python -m flashmoe_science.pipeline.ci.runner_requirements) and the environment
             check (python -m flashmoe_science env --require-gpu), with --python's interpreter.
  download   Download actions/runner $RUNNER_VERSION into $CACHE and check its SHA-256
             (install does this; no root needed where $CACHE is writable).
  install    As root, once per machine: preflight; download actions/runner $RUNNER_VERSION and
             check its SHA-256; install its dependencies; install this script, the job-started
             hook and the .env template under $ROOT/bin (root-owned); write $CONF;
             create one user per GPU (PREFIX-gpuN), kept out of cron and at ($ETC/cron.allow
             and at.allow without them; where those do not exist, listed in cron.deny and
             at.deny): a process cron starts is in no job's cgroup; install and start the systemd
             unit flashmoe-runner@N for each GPU.
  reset      As root, what \`once\` does first: reset the GPU's user (--gpu N) or --user USER.
  no-cron    As root, what install does for the runner users of --gpus: keep them out of cron and at.
  serve      What flashmoe-runner@N runs (as root): \`once\` in a loop, forever.
  once       One registration and one job for GPU N, as root: first the GPU's user is reset
             (its processes, crontab and at jobs stopped, its files in $SHARED_TMP
             deleted, its home recreated from $SKEL); then a fresh runner directory from the
             checked archive, its .env from runner.env, a just-in-time runner configuration from
             the API (POST /repos/OWNER/REPO/actions/runners/generate-jitconfig: one runner, one
             job; no registration token exists that a job could read and register runners with),
             and run.sh as the GPU's user in a cgroup of its own (a systemd scope, or a child
             cgroup of cgroup v2), which is killed whole when run.sh returns: nothing the job
             started survives, however it forked. On a systemd host the scope also gets a device
             cgroup: the job opens its own GPU's device node (/dev/nvidiaN) and the driver's
             shared ones, no other GPU's (--no-device-cgroup turns it off).

Options:
  --repo OWNER/REPO  The repository the runners serve (install writes it to $CONF).
  --kind KIND        The GPU label that workflows ask for: l4, h100 or h200, a leg of gpu-ci.yml
                     each (flashmoe_science/pipeline/gpukinds.py; default: l4).
  --gpus LIST        install: the GPUs to serve, "0,1" or "auto" (default: every GPU nvidia-smi lists).
  --gpu N            serve/once: the GPU (its index, as CUDA_VISIBLE_DEVICES takes it).
  --python PATH      The interpreter with the CUDA torch that jobs reuse
                     (default: /opt/torch/.venv/bin/python3).
  --user-prefix P    Runner users are P-gpuN (default: flashmoe-runner).
  --user USER        once: run as USER instead of PREFIX-gpuN (a user that is not the caller's own
                     has its leftover processes stopped after the job).
  --runner-group-id N  The runner group the runners join (default: 1, a repository's only group).
  --no-device-cgroup Do not restrict a job's devices to its own GPU (install writes it to $CONF).
  --dry-run          Print every command, download and API call instead of running it; needs no
                     root, no network and no credential.
  -h, --help         Show this help.

The credential: $TOKEN_FILE, owned by root, mode 0600, holding a fine-grained personal access
token limited to this one repository with the permission "Administration: Read and write"
(what the generate-jitconfig endpoint needs), or a GitHub App installation token with the same.
Only the service (root) reads it; the runner's users cannot, and a runner's .env holds no secret.
Each runner's just-in-time configuration (its own credential, good for that one runner) reaches
run.sh in its environment (ACTIONS_RUNNER_INPUT_JITCONFIG), never on a command line.

Environment overrides (tests, GitHub Enterprise Server): GITHUB_API_URL ($API_URL),
GITHUB_SERVER_URL ($SERVER_URL), FLASHMOE_RUNNER_DOWNLOAD_URL (with FLASHMOE_RUNNER_SHA256),
FLASHMOE_RUNNER_TOKEN_FILE, FLASHMOE_RUNNER_CONF, FLASHMOE_RUNNER_ROOT ($ROOT),
FLASHMOE_RUNNER_CACHE ($CACHE), FLASHMOE_RUNNER_UNIT_DIR ($UNIT_DIR), FLASHMOE_RUNNER_ETC ($ETC),
FLASHMOE_RUNNER_SKEL ($SKEL), FLASHMOE_RUNNER_SHARED_TMP, FLASHMOE_RUNNER_NVIDIA_PROC
($NVIDIA_PROC), FLASHMOE_RUNNER_USER_HOME (the home reset_user recreates), FLASHMOE_RUNNER_CONTAIN
(systemd, cgroup or none: how a job gets its cgroup; default: what the machine has).
Exit status: 0; 1 a step failed (its message says what to do); 2 a wrong option.
EOF
}

say() { echo "register: $*"; }
die() { echo "register: error: $1" >&2; echo "register: next: $2" >&2; exit 1; }
usage_error() { echo "register: error: $1 (see --help)" >&2; exit 2; }

DRY=0
COMMAND=""
REPO=""
KIND=""
GPUS=auto
GPU=""
PYTHON=""
USER_PREFIX=""
RUN_USER=""
RUNNER_GROUP_ID=""
DEVICE_CGROUP=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --repo) REPO="${2:?--repo needs OWNER/REPO}"; shift 2 ;;
    --kind) KIND="${2:?--kind needs a label}"; shift 2 ;;
    --gpus) GPUS="${2:?--gpus needs a list}"; shift 2 ;;
    --gpu) GPU="${2:?--gpu needs an index}"; shift 2 ;;
    --python) PYTHON="${2:?--python needs a path}"; shift 2 ;;
    --user-prefix) USER_PREFIX="${2:?--user-prefix needs a name}"; shift 2 ;;
    --user) RUN_USER="${2:?--user needs a name}"; shift 2 ;;
    --runner-group-id) RUNNER_GROUP_ID="${2:?--runner-group-id needs a number}"; shift 2 ;;
    --no-device-cgroup) DEVICE_CGROUP=0; shift ;;
    -h | --help) usage; exit 0 ;;
    preflight | download | install | serve | once | reset | no-cron)
      [[ -z "$COMMAND" ]] || usage_error "two commands given: $COMMAND and $1"
      COMMAND="$1"; shift ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done
[[ -n "$COMMAND" ]] || usage_error "no command given (preflight, download, install, serve, once, reset or no-cron)"

# serve and once read what install wrote; options given here win.
if [[ -f "$CONF" && "$COMMAND" != install ]]; then
  while IFS='=' read -r key value; do
    case "$key" in
      REPO) REPO="${REPO:-$value}" ;;
      KIND) KIND="${KIND:-$value}" ;;
      PYTHON) PYTHON="${PYTHON:-$value}" ;;
      USER_PREFIX) USER_PREFIX="${USER_PREFIX:-$value}" ;;
      RUNNER_GROUP_ID) RUNNER_GROUP_ID="${RUNNER_GROUP_ID:-$value}" ;;
      DEVICE_CGROUP) DEVICE_CGROUP="${DEVICE_CGROUP:-$value}" ;;
    esac
  done <"$CONF"
fi
KIND="${KIND:-l4}"
PYTHON="${PYTHON:-/opt/torch/.venv/bin/python3}"
USER_PREFIX="${USER_PREFIX:-flashmoe-runner}"
RUNNER_GROUP_ID="${RUNNER_GROUP_ID:-1}"
DEVICE_CGROUP="${DEVICE_CGROUP:-1}"
[[ "$RUNNER_GROUP_ID" =~ ^[1-9][0-9]*$ ]] || usage_error "--runner-group-id '$RUNNER_GROUP_ID' is not a number"
[[ "$DEVICE_CGROUP" =~ ^[01]$ ]] || usage_error "DEVICE_CGROUP in $CONF is '$DEVICE_CGROUP', not 0 or 1"
[[ "$KIND" =~ ^[a-z0-9][a-z0-9_-]*$ ]] || usage_error "--kind '$KIND' is not a label (lower case, digits, - and _)"
[[ "$USER_PREFIX" =~ ^[a-z_][a-z0-9_-]*$ ]] || usage_error "--user-prefix '$USER_PREFIX' is not a user name"

need_repo() {
  [[ "$REPO" =~ ^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$ ]] ||
    usage_error "--repo must be OWNER/REPO, got '${REPO:-nothing}'"
}
need_root() {
  ((DRY)) || [[ "$(id -u)" == 0 ]] ||
    die "$COMMAND must run as root (it creates users, writes $ROOT and systemd units)" \
      "run it with sudo, or add --dry-run to see what it would do"
}

# show CMD...: print a command as a shell would read it.
show() {
  local words=() word
  for word in "$@"; do
    if [[ "$word" =~ ^[][A-Za-z0-9_./:=,@%+-]+$ ]]; then words+=("$word"); else words+=("${word@Q}"); fi
  done
  echo "+ ${words[*]}"
}

# run CMD...: run it, or print it under --dry-run.
run() {
  if ((DRY)); then
    show "$@"
  else
    "$@"
  fi
}

# ---- preflight ----

preflight() {
  local repo_root
  repo_root="$(cd "$HERE/../.." && pwd)"
  say "preflight with $PYTHON"
  if ((DRY)); then
    echo "+ PYTHONPATH=$repo_root $PYTHON -m flashmoe_science.pipeline.ci.runner_requirements"
    echo "+ PYTHONPATH=$repo_root $PYTHON -m flashmoe_science env --require-gpu --json /dev/null"
    return 0
  fi
  [[ -x "$PYTHON" ]] ||
    die "no interpreter at $PYTHON" "install torch there (see docs/runners.md) or pass --python PATH"
  [[ -f "$repo_root/flashmoe_science/pipeline/ci/runner_requirements.py" ]] ||
    die "preflight needs the repository's checkout ($repo_root has none)" \
      "run scripts/runner/register.sh from a checkout of the repository"
  PYTHONPATH="$repo_root" "$PYTHON" -m flashmoe_science.pipeline.ci.runner_requirements ||
    die "the driver or nvcc does not match torch's CUDA (above)" "install the versions named above"
  # --json /dev/null: a check of the machine, not a CI record to leave in the checkout's reports/.
  PYTHONPATH="$repo_root" "$PYTHON" -m flashmoe_science env --require-gpu --json /dev/null ||
    die "the environment check failed (above)" "fix what it names, then rerun"
}

# ---- the runner archive ----

download() {
  local dest="$CACHE/$ARCHIVE"
  say "actions/runner $RUNNER_VERSION: $DOWNLOAD_URL"
  run mkdir -p "$CACHE"
  if ((DRY)); then
    echo "+ curl -fsSL -o $dest.part $DOWNLOAD_URL"
    echo "+ sha256sum -c <<< '$RUNNER_SHA256  $dest.part' && mv $dest.part $dest"
    return 0
  fi
  if [[ -f "$dest" ]] && sha256sum -c --status <<<"$RUNNER_SHA256  $dest"; then
    say "already downloaded and checked: $dest"
    return 0
  fi
  curl -fsSL --retry 3 -o "$dest.part" "$DOWNLOAD_URL" ||
    die "could not download $DOWNLOAD_URL" "check that this machine reaches github.com (or set FLASHMOE_RUNNER_DOWNLOAD_URL)"
  if ! sha256sum -c --status <<<"$RUNNER_SHA256  $dest.part"; then
    rm -f "$dest.part"
    die "$DOWNLOAD_URL does not have the SHA-256 $RUNNER_SHA256" \
      "do not use it; compare with the release page of actions/runner v$RUNNER_VERSION"
  fi
  mv "$dest.part" "$dest"
  say "checked: $dest (sha256 $RUNNER_SHA256)"
}

# ---- one registration, one job ----

runner_name() { echo "$(hostname -s)-gpu$1"; }
runner_labels() { echo "self-hosted,linux,x64,gpu,$KIND"; }

# render_env GPU DIR: the runner's .env from runner.env, comment lines dropped.
render_env() {
  local gpu="$1" dir="$2" template="$HERE/runner.env"
  sed -e '/^#/d' -e "s|@HOOK@|$ROOT/bin/cleanup-hook.sh|" -e "s|@WORK_DIR@|$dir/_work|" \
    -e "s|@PYTHON@|$PYTHON|" -e "s|@GPU@|$gpu|" \
    -e "s|@ALLOWED_WORKFLOW@|$REPO/.github/workflows/gpu-ci.yml@refs/heads/main|" "$template"
}

# api METHOD PATH [BODY]: a REST call with the credential, printing the answer. The header goes
# through curl's stdin, not its command line, which every user can read.
api() {
  local method="$1" path="$2" body="${3:-}" token
  [[ -r "$TOKEN_FILE" ]] ||
    die "cannot read the credential $TOKEN_FILE" "create it as root, mode 0600 (see --help)"
  token="$(<"$TOKEN_FILE")"
  printf 'header = "Authorization: Bearer %s"\n' "$token" |
    curl --config - -fsS -X "$method" -H "Accept: application/vnd.github+json" \
      -H "X-GitHub-Api-Version: 2022-11-28" ${body:+--data-binary "$body"} "$API_URL/$path"
}

# jit_config NAME LABELS: "RUNNER_ID JIT_CONFIG" for a new runner of this repository that takes one
# job (POST .../actions/runners/generate-jitconfig). No registration token exists: one would let
# whoever reads it (a job, from config.sh's /proc/PID/environ) register runners of their own.
jit_config() {
  local body answer path="repos/$REPO/actions/runners/generate-jitconfig"
  body="$(python3 -c 'import json, sys
print(json.dumps({"name": sys.argv[1], "runner_group_id": int(sys.argv[2]),
                  "labels": sys.argv[3].split(","), "work_folder": "_work"}))' \
    "$1" "$RUNNER_GROUP_ID" "$2")"
  answer="$(api POST "$path" "$body")" ||
    die "POST $API_URL/$path failed" "check that the token in $TOKEN_FILE is valid and has Administration: Read and write on $REPO"
  python3 -c 'import json, sys
d = json.load(sys.stdin)
print(int(d["runner"]["id"]), d["encoded_jit_config"])' <<<"$answer" 2>/dev/null ||
    die "POST $API_URL/$path answered without a runner configuration" \
      "check GITHUB_API_URL ($API_URL) and the repository name"
}

# ---- between jobs: the runner user as it was created ----

# reset_user USER: as root, before each job, remove what an earlier job of USER could leave for the
# next one outside the runner directory: its processes, crontab and `at` jobs, its files in the
# shared temporary folders, and its home (recreated from the skeleton). Never the caller's own
# user (a test or a developer running `once --user $USER`), never root.
reset_user() {
  local user="$1" uid group home dir ids=()
  if [[ "$user" == "$(id -un)" ]]; then
    say "reset: $user is this script's own user: its home, files and jobs are left alone"
    return 0
  fi
  if uid="$(id -u "$user" 2>/dev/null)"; then
    group="$(id -gn "$user")"
    home="${FLASHMOE_RUNNER_USER_HOME:-$(getent passwd "$user" | cut -d: -f6)}"
  elif ((DRY)); then # install's plan, before the user exists
    uid=-1 group="$user" home="${FLASHMOE_RUNNER_USER_HOME:-/home/$user}"
  else
    die "no user $user" "run: scripts/runner/register.sh install"
  fi
  ((uid != 0)) || die "refusing to reset root's home and files" "run the runner as its own user"
  say "reset: $user (what an earlier job left outside its runner directory)"
  # Job processes die with their cgroup; one of this user's found here was started outside it.
  if ((DRY)); then
    echo "+ pkill -KILL -u $user    # a process outside any job's cgroup (cron, at)"
  elif pkill -KILL -u "$user"; then
    say "warning: killed processes of $user that ran outside a job's cgroup (cron or at?)"
  fi
  if command -v crontab >/dev/null || ((DRY)); then
    run crontab -r -u "$user" 2>/dev/null || true
  fi
  if command -v atq >/dev/null; then
    mapfile -t ids < <(atq 2>/dev/null | awk -v u="$user" '$NF == u {print $1}')
    ((${#ids[@]} == 0)) || run atrm "${ids[@]}"
  elif ((DRY)); then
    echo "+ atrm <the at jobs of $user>"
  fi
  for dir in $SHARED_TMP; do
    [[ -d "$dir" ]] || continue
    # Its files anywhere below (a torchinductor_OTHER folder it made for a sibling included); a
    # folder of its own goes whole, whoever owns what is inside.
    run find "$dir" -xdev -mindepth 1 -user "$user" -prune -exec rm -rf --one-file-system -- '{}' +
  done
  if [[ -z "$home" || "$home" != /* || "$home" == / || -L "$home" ]]; then
    say "reset: $user's home '${home:-none}' is not a folder to recreate: left alone"
  elif ((!DRY)) && [[ ! -d "$home" || "$(stat -c %u "$home")" != "$uid" ]]; then
    say "reset: $home is not a folder of $user's: left alone"
  else
    run rm -rf --one-file-system -- "$home"
    run install -d -o "$user" -g "$group" -m 0750 "$home"
    run cp -rT "$SKEL" "$home"
    run chown -R "$user:$group" "$home"
  fi
}

# ---- the job in a cgroup of its own ----

# cgroup_here: this process's cgroup v2 folder, or nothing.
cgroup_here() {
  local mount path
  mount="$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts 2>/dev/null)"
  path="$(sed -n 's/^0:://p' /proc/self/cgroup 2>/dev/null)"
  [[ -n "$mount" && -n "$path" ]] && echo "$mount${path%/}"
}

# contain_mode: how this machine gives a job a cgroup of its own: `systemd` (a transient scope),
# `cgroup` (a child of this process's cgroup v2), or `none`. FLASHMOE_RUNNER_CONTAIN forces one.
contain_mode() {
  local here
  case "${FLASHMOE_RUNNER_CONTAIN:-auto}" in
    systemd | cgroup | none) echo "$FLASHMOE_RUNNER_CONTAIN" ;;
    *)
      here="$(cgroup_here)"
      if [[ -d /run/systemd/system ]] && command -v systemd-run >/dev/null; then
        echo systemd
      elif [[ -n "$here" && -w "$here/cgroup.procs" ]]; then
        echo cgroup
      else
        echo none
      fi
      ;;
  esac
}

# gpu_minor N: the minor number of GPU N's device node (/dev/nvidiaMINOR), from its PCI address.
gpu_minor() {
  local bus
  bus="$(nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader 2>/dev/null |
    awk -F', *' -v gpu="$1" '$1 == gpu {print tolower($2)}')"
  [[ -n "$bus" ]] || return 1
  bus="${bus#0000}" # nvidia-smi writes an 8-digit PCI domain, the driver's folders 4
  sed -n 's/^Device Minor:[[:space:]]*\([0-9][0-9]*\)[[:space:]]*$/\1/p' \
    "$NVIDIA_PROC/$bus/information" 2>/dev/null | grep .
}

# device_properties: the scope properties that let the job open its own GPU's device node and the
# driver's shared ones, and no other device but the standard pseudo devices (DEVICE_PROPS).
DEVICE_PROPS=()
device_properties() {
  local minor node
  DEVICE_PROPS=()
  if ((!DEVICE_CGROUP)); then
    say "device cgroup: off (--no-device-cgroup): the job can open every GPU's device node"
    return 0
  fi
  if ! minor="$(gpu_minor "$GPU")"; then
    say "device cgroup: GPU $GPU's device node is unknown (nvidia-smi, $NVIDIA_PROC): not applied"
    return 0
  fi
  DEVICE_PROPS=(-p DevicePolicy=closed -p "DeviceAllow=/dev/nvidia$minor rw")
  for node in /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools /dev/nvidia-modeset; do
    DEVICE_PROPS+=(-p "DeviceAllow=$node rw")
  done
  say "device cgroup: the job opens /dev/nvidia$minor (GPU $GPU) and the driver's shared nodes only"
}

# kill_cgroup DIR: every process in the cgroup DIR, then DIR itself. cgroup.kill is atomic, so a
# fork loop cannot outrun it; kernels without it get the cgroup frozen first.
kill_cgroup() {
  local cg="$1" pids=() pid
  mapfile -t pids <"$cg/cgroup.procs"
  if [[ -e "$cg/cgroup.kill" ]]; then
    echo 1 >"$cg/cgroup.kill"
  else
    echo 1 >"$cg/cgroup.freeze"
    for _ in {1..50}; do
      grep -q '^frozen 1' "$cg/cgroup.events" && break
      sleep 0.1
    done
    while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done <"$cg/cgroup.procs"
    echo 0 >"$cg/cgroup.freeze"
  fi
  for _ in {1..100}; do
    [[ -n "$(cat "$cg/cgroup.procs")" ]] || break
    sleep 0.1
  done
  ((${#pids[@]} == 0)) || say "stopped ${#pids[@]} process(es) the job left running"
  rmdir "$cg" 2>/dev/null || say "warning: $cg is not empty yet; it is tried again before the next job"
}

# job_cgroup: the name of GPU N's job cgroup, one per runner root (and so per machine's runners).
job_cgroup() { echo "flashmoe-job-$(cksum <<<"$ROOT" | cut -d' ' -f1)-gpu$GPU"; }

# run_job USER DIR: DIR/run.sh as USER (with the environment it is given), in a cgroup of its own,
# then everything still in that cgroup is killed: a job's processes cannot leave their cgroup,
# however they fork or daemonize.
run_job() {
  local user="$1" dir="$2" mode rc=0 unit cg cmd=(./run.sh)
  [[ "$user" == "$(id -un)" ]] || cmd=(runuser -u "$user" -- ./run.sh)
  mode="$(contain_mode)"
  case "$mode" in
    systemd)
      unit="flashmoe-job-gpu$GPU.scope"
      device_properties
      systemctl stop "$unit" 2>/dev/null || true # a job this script could not finish
      (cd "$dir" && systemd-run --quiet --scope --unit "$unit" -p KillMode=control-group \
        "${DEVICE_PROPS[@]}" -- "${cmd[@]}") || rc=$?
      systemctl kill --signal=SIGKILL "$unit" 2>/dev/null || true
      systemctl stop "$unit" 2>/dev/null || true
      say "the job's scope $unit is stopped, with every process left in it"
      ;;
    cgroup)
      cg="$(cgroup_here)/$(job_cgroup)"
      [[ ! -d "$cg" ]] || kill_cgroup "$cg" # a job this script could not finish
      mkdir "$cg"
      (cd "$dir" && echo "$BASHPID" >"$cg/cgroup.procs" && exec "${cmd[@]}") || rc=$?
      kill_cgroup "$cg"
      ;;
    *)
      [[ "$user" == "$(id -un)" ]] ||
        die "no cgroup to run $user's job in (no systemd, no writable cgroup v2)" \
          "run the runner on a systemd host, or as root in a container with cgroup v2"
      say "warning: no cgroup here: what the job leaves running is not stopped"
      (cd "$dir" && "${cmd[@]}") || rc=$?
      ;;
  esac
  return "$rc"
}

once() {
  need_repo
  [[ "$GPU" =~ ^[0-9]+$ ]] || usage_error "--gpu needs a GPU index, got '${GPU:-nothing}'"
  local user="${RUN_USER:-$USER_PREFIX-gpu$GPU}" dir="$ROOT/gpu$GPU" name labels id jit rc=0
  name="$(runner_name "$GPU")-$(date +%s)" # one registration per job: a name of its own
  labels="$(runner_labels)"
  say "GPU $GPU: runner $name ($labels) as user $user in $dir"
  ((DRY)) || [[ -f "$CACHE/$ARCHIVE" ]] ||
    die "no runner archive at $CACHE/$ARCHIVE" "run: scripts/runner/register.sh download (or install)"
  reset_user "$user"
  # A fresh directory from the checked archive: nothing of the last job's runner survives.
  run rm -rf --one-file-system "$dir"
  run mkdir -p "$dir"
  run tar -xzf "$CACHE/$ARCHIVE" -C "$dir"
  if ((DRY)); then
    echo "+ write $dir/.env:"
    render_env "$GPU" "$dir" | sed 's/^/    /'
  else
    render_env "$GPU" "$dir" >"$dir/.env"
  fi
  run mkdir -p "$dir/_work/_temp" # TMPDIR in the .env: it exists before the runner starts
  [[ "$user" == "$(id -un)" ]] || run chown -R "$user:" "$dir"
  if ((DRY)); then
    echo "+ curl -X POST -H 'Authorization: Bearer <the token in $TOKEN_FILE>' $API_URL/repos/$REPO/actions/runners/generate-jitconfig"
    echo "    {\"name\": \"$name\", \"runner_group_id\": $RUNNER_GROUP_ID, \"labels\": [\"${labels//,/\", \"}\"], \"work_folder\": \"_work\"}"
    echo "+ (in $dir, as $user, ACTIONS_RUNNER_INPUT_JITCONFIG=<the runner's JIT configuration>)"
    case "$(contain_mode)" in
      systemd)
        device_properties
        show systemd-run --scope --unit "flashmoe-job-gpu$GPU.scope" -p KillMode=control-group \
          "${DEVICE_PROPS[@]}" -- ./run.sh
        echo "+ systemctl kill --signal=SIGKILL flashmoe-job-gpu$GPU.scope    # whatever the job left running"
        ;;
      cgroup)
        echo "+ (in the cgroup $(cgroup_here)/$(job_cgroup)) ./run.sh"
        echo "+ echo 1 > $(cgroup_here)/$(job_cgroup)/cgroup.kill    # whatever the job left running"
        ;;
      *) echo "+ ./run.sh    # no cgroup here: refused unless $user is this script's own user" ;;
    esac
    echo "+ curl -X DELETE $API_URL/repos/$REPO/actions/runners/<its id>    # if it never took a job"
    return 0
  fi
  read -r id jit < <(jit_config "$name" "$labels") ||
    die "no runner configuration for $name" "read the message above; the service retries in a minute"
  [[ -n "$jit" ]] || die "no runner configuration for $name" "the service retries in a minute"
  say "registered $name (runner $id, just in time); waiting for one job"
  ACTIONS_RUNNER_INPUT_JITCONFIG="$jit" run_job "$user" "$dir" || rc=$?
  jit=""
  say "$name finished (run.sh exit $rc)"
  # An ephemeral runner unregisters after its job; one that never got one is removed here.
  api DELETE "repos/$REPO/actions/runners/$id" >/dev/null 2>&1 || true
  return "$rc"
}

serve() {
  need_root
  while true; do
    once || {
      say "retrying in 60 s"
      sleep 60
    }
    ((!DRY)) || return 0
  done
}

# ---- install ----

gpu_list() {
  if [[ "$GPUS" != auto ]]; then
    [[ "$GPUS" =~ ^[0-9]+(,[0-9]+)*$ ]] || usage_error "--gpus must be 'auto' or indices like 0,1; got '$GPUS'"
    tr ',' '\n' <<<"$GPUS"
    return 0
  fi
  command -v nvidia-smi >/dev/null ||
    die "--gpus auto needs nvidia-smi, and there is none" "install the NVIDIA driver, or pass --gpus 0,1,..."
  nvidia-smi --query-gpu=index --format=csv,noheader | tr -d ' ' ||
    die "nvidia-smi could not list the GPUs" "check the driver with nvidia-smi"
}

# no_cron USER...: keep the users out of cron and at. A process either starts is in no job's
# cgroup, so it would outlive the job and run beside the next one. Where FILE.allow exists they
# are taken out of it; where it does not, they go into FILE.deny (leaving other users as they were).
no_cron() {
  local tool allow deny user
  for tool in cron at; do
    allow="$ETC/$tool.allow" deny="$ETC/$tool.deny"
    if [[ -f "$allow" ]]; then
      for user in "$@"; do
        if grep -qx -- "$user" "$allow"; then
          say "$allow: removing $user"
          run sed -i "/^$user\$/d" "$allow"
        fi
      done
      say "$allow: the runner users are not in it: $tool refuses them"
    else
      for user in "$@"; do
        if ((DRY)); then
          echo "+ echo $user >> $deny"
        elif ! grep -qsx -- "$user" "$deny"; then
          echo "$user" >>"$deny"
        fi
      done
      say "$deny: lists the runner users ($allow does not exist): $tool refuses them"
    fi
  done
}

# Not `install`: that name is the install(1) this script runs.
install_runners() {
  need_repo
  need_root
  local gpus=() gpu user listed
  listed="$(gpu_list)" # a failure here stops the script with gpu_list's message and status
  mapfile -t gpus <<<"$listed"
  [[ -n "$listed" ]] || die "no GPU found" "check nvidia-smi, or pass --gpus"
  say "installing ${#gpus[@]} runner(s) for $REPO, one per GPU: ${gpus[*]}"
  preflight
  download
  say "the runner's system dependencies (its bin/installdependencies.sh)"
  local deps="$CACHE/deps"
  run rm -rf "$deps"
  run mkdir -p "$deps"
  run tar -xzf "$CACHE/$ARCHIVE" -C "$deps"
  run "$deps/bin/installdependencies.sh"
  run rm -rf "$deps"
  say "$ROOT/bin: this script, the hook and the .env template, root-owned and read-only to the runners"
  run install -d -o root -g root -m 0755 "$ROOT" "$ROOT/bin"
  run install -o root -g root -m 0755 "$HERE/register.sh" "$HERE/cleanup-hook.sh" "$ROOT/bin/"
  run install -o root -g root -m 0644 "$HERE/runner.env" "$ROOT/bin/"
  say "$CONF"
  run install -d -o root -g root -m 0755 "$(dirname "$CONF")"
  if ((DRY)); then
    echo "+ write $CONF: REPO=$REPO KIND=$KIND PYTHON=$PYTHON USER_PREFIX=$USER_PREFIX RUNNER_GROUP_ID=$RUNNER_GROUP_ID DEVICE_CGROUP=$DEVICE_CGROUP"
  else
    printf 'REPO=%s\nKIND=%s\nPYTHON=%s\nUSER_PREFIX=%s\nRUNNER_GROUP_ID=%s\nDEVICE_CGROUP=%s\n' \
      "$REPO" "$KIND" "$PYTHON" "$USER_PREFIX" "$RUNNER_GROUP_ID" "$DEVICE_CGROUP" >"$CONF"
  fi
  if ((DRY)); then
    echo "+ test: $TOKEN_FILE exists, owned by root, mode 0600"
  elif [[ ! -f "$TOKEN_FILE" ]]; then
    die "no credential at $TOKEN_FILE" \
      "create it: install -m 0600 /dev/null $TOKEN_FILE, write the token into it, rerun (see --help)"
  elif [[ "$(stat -c '%u %a' "$TOKEN_FILE")" != "0 600" ]]; then
    die "$TOKEN_FILE must be owned by root with mode 0600" "chown root:root $TOKEN_FILE && chmod 0600 $TOKEN_FILE"
  fi
  local users=()
  for gpu in "${gpus[@]}"; do
    user="$USER_PREFIX-gpu$gpu"
    users+=("$user")
    say "GPU $gpu: user $user, runner $(runner_name "$gpu"), labels $(runner_labels), CUDA_VISIBLE_DEVICES=$gpu"
    if ((DRY)) || ! id -u "$user" >/dev/null 2>&1; then
      run useradd --system --create-home --shell /usr/sbin/nologin "$user"
    fi
  done
  no_cron "${users[@]}"
  say "the systemd unit flashmoe-runner@.service, one instance per GPU"
  if ((DRY)); then
    echo "+ write $UNIT_DIR/flashmoe-runner@.service from $HERE/flashmoe-runner@.service"
  else
    sed -e "s|@ROOT@|$ROOT|g" -e "s|@TOKEN_FILE@|$TOKEN_FILE|g" "$HERE/flashmoe-runner@.service" \
      >"$UNIT_DIR/flashmoe-runner@.service"
  fi
  run systemctl daemon-reload
  for gpu in "${gpus[@]}"; do
    run systemctl enable --now "flashmoe-runner@$gpu"
  done
  if ((DRY)); then
    say "what each flashmoe-runner@N does before every job (register.sh once), for GPU ${gpus[0]}:"
    GPU="${gpus[0]}" once
  else
    say "done: 'systemctl status flashmoe-runner@${gpus[0]}' shows the first registration"
  fi
}

reset_command() {
  need_root
  [[ -n "$RUN_USER" || "$GPU" =~ ^[0-9]+$ ]] || usage_error "reset needs --gpu N or --user USER"
  reset_user "${RUN_USER:-$USER_PREFIX-gpu$GPU}"
}

no_cron_command() {
  need_root
  local listed gpus=() users=() gpu
  listed="$(gpu_list)"
  mapfile -t gpus <<<"$listed"
  for gpu in "${gpus[@]}"; do users+=("$USER_PREFIX-gpu$gpu"); done
  no_cron "${users[@]}"
}

case "$COMMAND" in
  reset) reset_command ;;
  no-cron) no_cron_command ;;
  preflight) preflight ;;
  download) download ;;
  install) install_runners ;;
  serve) serve ;;
  once) once ;;
esac
