#!/usr/bin/env bash
# Install a hash-locked requirements file (requirements/*.txt) into a fresh venv and put it on the
# job's PATH: see --help.
set -euo pipefail

usage() {
  cat <<'EOF2'
Usage: scripts/runner/install-locked.sh [--venv DIR] LOCKFILE

Creates the venv DIR (default: $RUNNER_TEMP/locked-venv) and installs LOCKFILE into it with
`pip install --require-hashes --only-binary :all: --no-deps`: every package pinned with `==` and its
sha256, wheels only (no build step runs code at install time), from one index (PyPI, or
$PIP_INDEX_URL: never an extra index). Then appends DIR/bin to $GITHUB_PATH when it is set.
pip's configuration files are ignored (PIP_CONFIG_FILE=/dev/null), so a machine's extra index or
find-links cannot add a source. Under nektos/act (ACT set), when python3 already has every pinned
version, installs nothing; with FLASHMOE_SETUP_NO_INSTALL=1 (run-job.sh --offline: no package index)
it installs nothing and the job uses what python3 imports, with a warning.

Regenerate a lock file after editing its .in beside it:
  uv pip compile --generate-hashes --python-version 3.12 \
    --python-platform x86_64-manylinux_2_28 --index-url https://pypi.org/simple --no-header \
    requirements/NAME.in -o requirements/NAME.txt
EOF2
}

VENV="${RUNNER_TEMP:-/tmp}/locked-venv"
LOCK=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --venv) VENV="${2:?--venv needs a value}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "install-locked: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) LOCK="$1"; shift ;;
  esac
done
[[ -n "$LOCK" && -f "$LOCK" ]] || { echo "install-locked: no lock file '${LOCK}' (see --help)" >&2; exit 2; }
if ! grep -q -- '--hash=sha256:' "$LOCK"; then
  echo "install-locked: $LOCK has no hashes; regenerate it (see --help)" >&2
  exit 2
fi

if [[ -n "${ACT:-}" ]] && python3 - "$LOCK" <<'PY'; then
import importlib.metadata as md, re, sys
pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", open(sys.argv[1]).read(), re.M)
try:
    sys.exit(0 if all(md.version(n) == v for n, v in pins) else 1)
except md.PackageNotFoundError:
    sys.exit(1)
PY
  echo "install-locked: act run, python3 has every pinned version already: installing nothing"
  exit 0
fi

if [[ "${FLASHMOE_SETUP_NO_INSTALL:-}" == 1 ]]; then
  echo "::warning::install-locked: FLASHMOE_SETUP_NO_INSTALL=1: $LOCK not installed; using python3's own packages"
  exit 0
fi

python3 -m venv "$VENV"
PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install --disable-pip-version-check --quiet --require-hashes --only-binary :all: \
  --no-deps --index-url "${PIP_INDEX_URL:-https://pypi.org/simple}" -r "$LOCK"
echo "install-locked: $LOCK -> $VENV"
if [[ -n "${GITHUB_PATH:-}" ]]; then
  echo "$VENV/bin" >>"$GITHUB_PATH"
fi
