#!/bin/sh
# Developer helper: export the patch series from a git work tree of the pinned upstream tree whose
# first commit is the pristine tree (see docs/DEVELOPING.md). Usage: patches/export.sh /path/to/llama-git
set -eu
src=${1:?usage: patches/export.sh LLAMA_GIT_TREE}
here=$(cd "$(dirname "$0")" && pwd)
base=$(git -C "$src" rev-list --max-parents=0 HEAD)
rm -f "$here"/[0-9][0-9][0-9][0-9]-*.patch
git -C "$src" format-patch -q --no-signature --zero-commit -N -o "$here" "$base"..HEAD
{
  echo "# pyllama_pp patch series, applied in order to the pinned tree (vendor/llama.cpp/PIN)"
  (cd "$here" && ls [0-9][0-9][0-9][0-9]-*.patch)
} > "$here/series"
cat "$here/series"
