#!/usr/bin/env bash
# Write requirements.lock: the exact version of every package (dependencies included) that an install of
# requirements.txt's ranges resolves to. The install is a real one, through create_venv.sh and ending in
# pip check, into a throwaway venv: ${VENV_DIR:-venv} is never touched.
#   bash tools/lock_requirements.sh        after any edit to requirements.txt; commit both files together
# PYTHON picks the interpreter, as in create_venv.sh. The lock holds the wheels pip picks for that Python and
# this OS and machine (torch's CUDA dependencies on Linux x86_64), so lock with the Python users run.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

REQUIREMENTS=requirements.txt VENV_DIR="$scratch/venv" bash create_venv.sh
python="$scratch/venv/bin/python"
{
    echo "# Exact versions of an install of requirements.txt; update_req.sh installs this file. Do not edit:"
    echo "# bash tools/lock_requirements.sh regenerates it."
    echo "# requirements.txt sha256 (requirement lines): $(bash tools/requirement_lines_hash.sh)"
    echo "# platform: $("$python" tools/python_platform.py)"
    echo "# resolved by: $("$python" -m pip --version | cut -d' ' -f1-2)"
    # --all keeps setuptools (torch and tensorboard require it); pip itself is upgraded by update_req.sh first.
    "$python" -m pip freeze --all --exclude pip
} > "$scratch/requirements.lock"
# A package installed from a path or URL would be frozen as "name @ location", which no other machine can use.
if grep -n ' @ ' "$scratch/requirements.lock" >&2; then
    echo "requirements.lock would hold the lines above (installed from a path or URL): install them from an index." >&2
    exit 1
fi
mv "$scratch/requirements.lock" requirements.lock
echo "Wrote requirements.lock ($(grep -vc '^#' requirements.lock) packages)."
