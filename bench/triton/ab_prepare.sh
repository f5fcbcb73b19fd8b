#!/bin/bash
# Host side of a commit A/B: each REV's tree, as bench_full.py needs it (ds4/, the bench scripts,
# pyproject.toml), into ab/<REV>/ (git-ignored; AB_DIR names another folder), for ab_trees.sh to
# time on the GPU machine.
# The working tree itself is timed as "." (no copy). Usage: bash bench/triton/ab_prepare.sh REV...
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 REV... (commits to time against the working tree)" >&2; exit 2; }
cd "$(git rev-parse --show-toplevel)"
for rev in "$@"; do
  sha=$(git rev-parse --verify --short "$rev^{commit}") || { echo "$0: no commit $rev" >&2; exit 2; }
  dest="${AB_DIR:-ab}/$sha"
  # the bench scripts that commit has (older trees lack some)
  files=$(git ls-tree --name-only "$sha" bench/triton/ | grep -E '\.py$' || true)
  tmp="${AB_DIR:-ab}/.tmp-$sha-$$"
  trap 'rm -rf "$tmp"' EXIT
  rm -rf "$tmp" && mkdir -p "$tmp"
  git archive "$sha" ds4 pyproject.toml $files | tar x -C "$tmp"
  rm -rf "$dest" && mv "$tmp" "$dest"
  echo "$dest ($(git log -1 --format=%s "$sha"))"
done
