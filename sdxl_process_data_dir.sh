#!/usr/bin/env bash
# Cache a dataset. Any flag of sdxl_process_data_dir.py can be appended, e.g.:
#   bash sdxl_process_data_dir.sh --data_dir /data/images --cache_dir /data/cache
#   VENV_DIR   virtual env to use (default: venv next to this script; created if missing)
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
[ -x "$VENV_DIR/bin/python" ] || bash create_venv.sh
exec "$VENV_DIR/bin/python" sdxl_process_data_dir.py "$@"
