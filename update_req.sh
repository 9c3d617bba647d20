#!/usr/bin/env bash
# Install requirements.txt into ${VENV_DIR:-venv}. A stamp holding the hash of requirements.txt makes
# a re-run with unchanged requirements return in well under a second; FORCE=1 reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
if [ ! -x "$VENV_DIR/bin/python" ]; then
    echo "No virtual env at $VENV_DIR: run 'bash create_venv.sh' first." >&2
    exit 1
fi

stamp="$VENV_DIR/.requirements.sha256"
wanted=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "${FORCE:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "Requirements already installed in $VENV_DIR (requirements.txt unchanged)."
    exit 0
fi

"$VENV_DIR/bin/python" -m pip install --upgrade --quiet pip
"$VENV_DIR/bin/python" -m pip install --upgrade-strategy only-if-needed -r requirements.txt
"$VENV_DIR/bin/python" -m pip check
echo "$wanted" > "$stamp"
echo "Requirements installed in $VENV_DIR."
