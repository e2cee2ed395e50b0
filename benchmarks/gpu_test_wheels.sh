#!/usr/bin/env bash
# The test tools as wheels (pytest, pytest-timeout, pytest-xdist, hypothesis and their pure-Python
# needs; about 3 MiB) in .gpu/wheels, for a GPU host without a package index that lacks them.
# The GPU hosts seen so far ship all four, so this is a fallback: carry it only if
# benchmarks/gpu_smoke.py reported pytest missing there; gpu_session.sh installs .gpu/wheels
# into /tmp/site only when `import pytest` fails. Run here, from the repository root.
set -eu
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
mkdir -p .gpu/wheels "$(dirname "$exclude")"
grep -qx "/.gpu/" "$exclude" 2>/dev/null || echo "/.gpu/" >> "$exclude"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d .gpu/wheels pytest pytest-timeout pytest-xdist hypothesis
du -sh .gpu/wheels
