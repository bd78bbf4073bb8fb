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
             create one user per GPU (PREFIX-gpuN); install and start the systemd unit
             flashmoe-runner@N for each GPU.
  serve      What flashmoe-runner@N runs (as root): \`once\` in a loop, forever.
  once       One registration and one job for GPU N: a fresh runner directory from the checked
             archive, its .env from runner.env, a registration token from the API
             (POST /repos/OWNER/REPO/actions/runners/registration-token), config.sh --unattended
             --ephemeral as the GPU's user, run.sh until its one job ends, then every process
             that user left is stopped.

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
  --dry-run          Print every command, download and API call instead of running it; needs no
                     root, no network and no credential.
  -h, --help         Show this help.

The credential: $TOKEN_FILE, owned by root, mode 0600, holding a fine-grained personal access
token limited to this one repository with the permission "Administration: Read and write"
(what the registration-token endpoint needs), or a GitHub App installation token with the same.
Only the service (root) reads it; the runner's users cannot, and a runner's .env holds no secret.
Each registration token it obtains lives one hour and is handed to config.sh in its environment
(ACTIONS_RUNNER_INPUT_TOKEN), which other users cannot read, never on a command line.

Environment overrides (tests, GitHub Enterprise Server): GITHUB_API_URL ($API_URL),
GITHUB_SERVER_URL ($SERVER_URL), FLASHMOE_RUNNER_DOWNLOAD_URL (with FLASHMOE_RUNNER_SHA256),
FLASHMOE_RUNNER_TOKEN_FILE, FLASHMOE_RUNNER_CONF, FLASHMOE_RUNNER_ROOT ($ROOT),
FLASHMOE_RUNNER_CACHE ($CACHE), FLASHMOE_RUNNER_UNIT_DIR ($UNIT_DIR).
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
    -h | --help) usage; exit 0 ;;
    preflight | download | install | serve | once)
      [[ -z "$COMMAND" ]] || usage_error "two commands given: $COMMAND and $1"
      COMMAND="$1"; shift ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done
[[ -n "$COMMAND" ]] || usage_error "no command given (preflight, download, install, serve or once)"

# serve and once read what install wrote; options given here win.
if [[ -f "$CONF" && "$COMMAND" != install ]]; then
  while IFS='=' read -r key value; do
    case "$key" in
      REPO) REPO="${REPO:-$value}" ;;
      KIND) KIND="${KIND:-$value}" ;;
      PYTHON) PYTHON="${PYTHON:-$value}" ;;
      USER_PREFIX) USER_PREFIX="${USER_PREFIX:-$value}" ;;
    esac
  done <"$CONF"
fi
KIND="${KIND:-l4}"
PYTHON="${PYTHON:-/opt/torch/.venv/bin/python3}"
USER_PREFIX="${USER_PREFIX:-flashmoe-runner}"
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

# as_user USER CMD...: run CMD as USER with USER's HOME (runuser keeps the caller's other variables).
as_user() {
  local user="$1"
  shift
  if [[ "$user" == "$(id -un)" ]]; then
    "$@"
  else
    runuser -u "$user" -- "$@"
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
  [[ -f "$repo_root/flashmoe_science/pipeline/runner_requirements.py" ]] ||
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

registration_token() {
  local url="$API_URL/repos/$REPO/actions/runners/registration-token" token body
  [[ -r "$TOKEN_FILE" ]] ||
    die "cannot read the credential $TOKEN_FILE" "create it as root, mode 0600 (see --help)"
  token="$(<"$TOKEN_FILE")"
  # The header goes through curl's stdin, not its command line, which every user can read.
  body="$(printf 'header = "Authorization: Bearer %s"\n' "$token" |
    curl --config - -fsS -X POST -H "Accept: application/vnd.github+json" \
      -H "X-GitHub-Api-Version: 2022-11-28" "$url")" ||
    die "POST $url failed" "check that the token in $TOKEN_FILE is valid and has Administration: Read and write on $REPO"
  python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])' <<<"$body" 2>/dev/null ||
    die "POST $url answered without a token" "check GITHUB_API_URL ($API_URL) and the repository name"
}

once() {
  need_repo
  [[ "$GPU" =~ ^[0-9]+$ ]] || usage_error "--gpu needs a GPU index, got '${GPU:-nothing}'"
  local user="${RUN_USER:-$USER_PREFIX-gpu$GPU}" dir="$ROOT/gpu$GPU" name labels token
  name="$(runner_name "$GPU")"
  labels="$(runner_labels)"
  say "GPU $GPU: runner $name ($labels) as user $user in $dir"
  ((DRY)) || [[ -f "$CACHE/$ARCHIVE" ]] ||
    die "no runner archive at $CACHE/$ARCHIVE" "run: scripts/runner/register.sh download (or install)"
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
  run mkdir -p "$dir/_work"
  [[ "$user" == "$(id -un)" ]] || run chown -R "$user:" "$dir"
  local config=(./config.sh --unattended --url "$SERVER_URL/$REPO" --name "$name" --labels "$labels"
    --work _work --ephemeral --disableupdate --replace)
  if ((DRY)); then
    echo "+ curl -X POST -H 'Authorization: Bearer <the token in $TOKEN_FILE>' $API_URL/repos/$REPO/actions/runners/registration-token"
    echo "+ (in $dir, as $user, ACTIONS_RUNNER_INPUT_TOKEN=<the registration token>)"
    show "${config[@]}"
    echo "+ (in $dir, as $user) ./run.sh    # returns when its one job has ended"
    [[ "$user" == "$(id -un)" ]] || echo "+ pkill -KILL -u $user    # whatever the job left running"
    return 0
  fi
  token="$(registration_token)"
  (cd "$dir" && ACTIONS_RUNNER_INPUT_TOKEN="$token" as_user "$user" "${config[@]}") ||
    die "config.sh failed for $name" "read its message above; the service retries in a minute"
  token=""
  say "registered $name; waiting for one job"
  local rc=0
  (cd "$dir" && as_user "$user" ./run.sh) || rc=$?
  say "$name finished (run.sh exit $rc)"
  if [[ "$user" != "$(id -un)" ]]; then
    if pkill -KILL -u "$user"; then say "stopped what $user left running"; fi
  fi
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

install() {
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
    echo "+ write $CONF: REPO=$REPO KIND=$KIND PYTHON=$PYTHON USER_PREFIX=$USER_PREFIX"
  else
    printf 'REPO=%s\nKIND=%s\nPYTHON=%s\nUSER_PREFIX=%s\n' "$REPO" "$KIND" "$PYTHON" "$USER_PREFIX" >"$CONF"
  fi
  if ((DRY)); then
    echo "+ test: $TOKEN_FILE exists, owned by root, mode 0600"
  elif [[ ! -f "$TOKEN_FILE" ]]; then
    die "no credential at $TOKEN_FILE" \
      "create it: install -m 0600 /dev/null $TOKEN_FILE, write the token into it, rerun (see --help)"
  elif [[ "$(stat -c '%u %a' "$TOKEN_FILE")" != "0 600" ]]; then
    die "$TOKEN_FILE must be owned by root with mode 0600" "chown root:root $TOKEN_FILE && chmod 0600 $TOKEN_FILE"
  fi
  for gpu in "${gpus[@]}"; do
    user="$USER_PREFIX-gpu$gpu"
    say "GPU $gpu: user $user, runner $(runner_name "$gpu"), labels $(runner_labels), CUDA_VISIBLE_DEVICES=$gpu"
    if ((DRY)) || ! id -u "$user" >/dev/null 2>&1; then
      run useradd --system --create-home --shell /usr/sbin/nologin "$user"
    fi
  done
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

case "$COMMAND" in
  preflight) preflight ;;
  download) download ;;
  install) install ;;
  serve) serve ;;
  once) once ;;
esac
