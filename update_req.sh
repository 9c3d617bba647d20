#!/usr/bin/env bash
# Install the locked requirements into ${VENV_DIR:-venv}: requirements.lock holds the exact version of every
# package (tools/lock_requirements.sh writes it from requirements.txt), so pip installs without backtracking.
#   bash update_req.sh                                   the lock (what the test suite passed with)
#   REQUIREMENTS=requirements.txt bash update_req.sh     the minor-version ranges instead, e.g. into an env of yours
#                                                        (a relative path is read from this folder)
# A stamp holding the installed file's name and hash makes a re-run return in well under a second; FORCE=1
# reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
REQUIREMENTS=${REQUIREMENTS:-requirements.lock}
if [ ! -x "$VENV_DIR/bin/python" ]; then
    echo "No virtual env at $VENV_DIR: run 'bash create_venv.sh' first." >&2
    exit 1
fi
if [ ! -f "$REQUIREMENTS" ]; then
    echo "No file $REQUIREMENTS (REQUIREMENTS names a file in $PWD or an absolute path)." >&2
    exit 1
fi

# A lock made from another requirements.txt would install versions nobody asked for; stop rather than fall back
# to the ranges, so an edit to requirements.txt cannot reach users or CI without a new lock (committed with it).
locked_from=$(sed -n 's/^# requirements.txt sha256 (requirement lines): //p' "$REQUIREMENTS")
if [ -n "$locked_from" ] && [ "$locked_from" != "$(bash tools/requirement_lines_hash.sh)" ]; then
    echo "$REQUIREMENTS was made from another requirements.txt: run 'bash tools/lock_requirements.sh' (or install the ranges: REQUIREMENTS=requirements.txt bash update_req.sh)." >&2
    exit 1
fi

stamp="$VENV_DIR/.requirements.sha256"
wanted=$(sha256sum "$REQUIREMENTS")
if [ "${FORCE:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "Requirements already installed in $VENV_DIR ($REQUIREMENTS unchanged)."
    exit 0
fi

# A lock pins the wheels of the platform it was resolved on; elsewhere some pins may not exist (torch's CUDA
# packages exist for Linux only). Warn rather than stop: only pip can tell whether every pin exists here.
locked_for=$(sed -n 's/^# platform: //p' "$REQUIREMENTS")
this_env=$("$VENV_DIR/bin/python" tools/python_platform.py)
if [ -n "$locked_for" ] && [ "$locked_for" != "$this_env" ]; then
    echo "Warning: $REQUIREMENTS was resolved on $locked_for, $VENV_DIR runs $this_env; if the install fails, install the ranges: REQUIREMENTS=requirements.txt bash update_req.sh" >&2
fi

"$VENV_DIR/bin/python" -m pip install --upgrade --quiet pip
"$VENV_DIR/bin/python" -m pip install --upgrade-strategy only-if-needed -r "$REQUIREMENTS"
"$VENV_DIR/bin/python" -m pip check
echo "$wanted" > "$stamp"
echo "Requirements from $REQUIREMENTS installed in $VENV_DIR."
