#!/usr/bin/env bash
# Download the wheels of bench/models/wheels.txt (Python 3.12, manylinux x86_64) into .whl/
# at the repository root, for a GPU machine that reaches no registry. Then, there:
#   pip install --no-deps .whl/*.whl && pip install --no-deps -e .
# .whl/ is in .gitignore: wheels are never committed.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$root/.whl"
grep -v '^\s*#' "$root/bench/models/wheels.txt" | grep -v '^\s*$' > "$root/.whl/requirements.txt"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$root/.whl" -r "$root/.whl/requirements.txt"
rm "$root/.whl/requirements.txt"
du -ch "$root"/.whl/*.whl | tail -1
