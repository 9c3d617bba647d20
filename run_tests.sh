#!/usr/bin/env bash
# Create or update the virtual env, then run the whole test suite (offline, CPU only).
# Extra arguments go to pytest, e.g.: bash run_tests.sh -k buckets
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
bash create_venv.sh
export HF_HUB_OFFLINE=1
exec "$VENV_DIR/bin/python" -m pytest tests "$@"
