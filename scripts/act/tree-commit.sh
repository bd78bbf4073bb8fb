#!/usr/bin/env bash
# Print the commit that holds this working tree as it is: HEAD when the tree matches it, else a
# snapshot commit (HEAD its parent; tracked changes and untracked files that .gitignore does not
# ignore) kept reachable under refs/act/snapshot. The index, HEAD and the branches are left as
# they were. A job under act checks out a commit, so this is what makes it run the tree it was
# given (gpu-job.sh on a GPU machine's copy, whose HEAD need not be the tree's).
set -euo pipefail

case "${1:-}" in
  -h | --help)
    echo "Usage: scripts/act/tree-commit.sh   (in a git checkout; prints a commit id)"
    exit 0
    ;;
  "") ;;
  *)
    echo "tree-commit.sh: no arguments expected, got '$1' (see --help)" >&2
    exit 2
    ;;
esac

head="$(git rev-parse --verify -q HEAD || true)"
if [[ -n "$head" && -z "$(git status --porcelain --untracked-files=normal)" ]]; then
  echo "$head"
  exit 0
fi
index="$(mktemp)"
trap 'rm -f "$index"' EXIT
index_path="$(git rev-parse --git-path index)"
if [[ -f "$index_path" ]]; then cp "$index_path" "$index"; else rm -f "$index"; fi
GIT_INDEX_FILE="$index" git add -A
tree="$(GIT_INDEX_FILE="$index" git write-tree)"
parent=()
[[ -z "$head" ]] || parent=(-p "$head")
commit="$(git -c user.name=act -c user.email=act@localhost -c commit.gpgsign=false \
  commit-tree "$tree" "${parent[@]}" -m "act: snapshot of the working tree")"
git update-ref refs/act/snapshot "$commit"
echo "$commit"
