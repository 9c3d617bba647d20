#!/usr/bin/env bash
# Install ${REQUIREMENTS:-requirements.txt} into ${VENV_DIR:-venv} (a relative path is read from this folder).
# A stamp holding the installed file's name and hash makes a re-run with unchanged requirements return in well
# under a second; FORCE=1 reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
REQUIREMENTS=${REQUIREMENTS:-requirements.txt}
if [ ! -x "$VENV_DIR/bin/python" ]; then
    echo "No virtual env at $VENV_DIR: run 'bash create_venv.sh' first." >&2
    exit 1
fi

stamp="$VENV_DIR/.requirements.sha256"
wanted=$(sha256sum "$REQUIREMENTS")
if [ "${FORCE:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "Requirements already installed in $VENV_DIR ($REQUIREMENTS unchanged)."
    exit 0
fi

"$VENV_DIR/bin/python" -m pip install --upgrade --quiet pip
"$VENV_DIR/bin/python" -m pip install --upgrade-strategy only-if-needed -r "$REQUIREMENTS"
"$VENV_DIR/bin/python" -m pip check
echo "$wanted" > "$stamp"
echo "Requirements from $REQUIREMENTS installed in $VENV_DIR."
