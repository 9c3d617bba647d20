#!/usr/bin/env bash
# The SHA-256 of requirements.txt's requirement lines: comments and blank lines left out, as they change
# nothing pip resolves. requirements.lock records it; update_req.sh compares it.
set -euo pipefail
cd "$(dirname "$0")/.."
sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e '/^$/d' requirements.txt | sha256sum | cut -d' ' -f1
