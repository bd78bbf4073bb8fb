#!/usr/bin/env bash
# Check a CI job's report folder as pr-report.yml reads the artifact made from it. The workflows run
# this only under nektos/act (scripts/act/run-job.sh), where the upload goes to a local stand-in:
# it stands for what GitHub would have received.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/act/check-artifact.sh DIR [EVENT]

Checks that DIR (the folder the job uploads, e.g. reports/) exists and holds report.md, a regular
file of fewer than 65,536 characters (GitHub's comment limit; pr-report.yml cuts a report of over
65,000 bytes). For EVENT pull_request it also checks DIR/pr.json: the PR number pr-report.yml
accepts (1-10 digits) and a head_sha. Appends one line to $GITHUB_STEP_SUMMARY when that is set.
Exit status: 0 when all checks pass, 1 otherwise, 2 for wrong arguments.
EOF
}

case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
dir="${1%/}"
event="${2:-}"
failures=0
notes=()

fail() { echo "::error::artifact check: $1"; failures=$((failures + 1)); }

if [[ ! -d "$dir" || -L "$dir" ]]; then
  fail "$dir/ is not a folder: nothing would be uploaded"
else
  report="$dir/report.md"
  if [[ ! -f "$report" || -L "$report" ]]; then
    fail "$report is missing (or a link): pr-report.yml would post 'no report'"
  else
    bytes=$(wc -c <"$report")
    chars=$(LC_ALL=C.UTF-8 wc -m <"$report" 2>/dev/null || echo "$bytes")
    if ((chars >= 65536)); then
      fail "$report has $chars characters: over GitHub's 65,536-character comment limit"
    elif ((bytes > 65000)); then
      echo "::warning::artifact check: $report has $bytes bytes: pr-report.yml will cut it to 64,000"
    fi
    notes+=("report.md $chars characters")
  fi
  if [[ "$event" == pull_request ]]; then
    pr="$dir/pr.json"
    if [[ ! -f "$pr" ]]; then
      fail "$pr is missing: pr-report.yml would not comment"
    elif ! fields="$(python3 - "$pr" <<'EOF'
import json, re, sys
data = json.load(open(sys.argv[1]))
number, sha = str(data.get("number", "")), str(data.get("head_sha", ""))
if not re.fullmatch(r"[1-9][0-9]{0,9}", number) or not sha:
    sys.exit(f"number {number!r}, head_sha {sha!r}")
print(f"pr.json: PR #{number}, head {sha[:12] or '?'}")
EOF
    )"; then
      fail "$pr is not what pr-report.yml accepts (see the message above)"
    else
      notes+=("$fields")
    fi
  fi
fi

if ((failures)); then
  line="act artifact check: $failures problem(s) in $dir/"
else
  printf -v joined '%s; ' "${notes[@]}"
  line="act artifact check: $dir/ passed (${joined%; })"
fi
echo "$line"
if [[ -n "${GITHUB_STEP_SUMMARY:-}" ]]; then
  printf '\n> %s\n' "$line" >>"$GITHUB_STEP_SUMMARY"
fi
((failures == 0))
