#!/usr/bin/env bash
# Create the virtual environment at ${VENV_DIR:-venv} (next to this script) and install the requirements
# (update_req.sh: requirements.lock, or the file named by REQUIREMENTS).
# Re-running is safe: an existing env is reused and update_req.sh returns at once when nothing changed.
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV_DIR/bin/python" ]; then
    echo "Creating virtual env in $VENV_DIR with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV_DIR"
fi
VENV_DIR="$VENV_DIR" bash update_req.sh
