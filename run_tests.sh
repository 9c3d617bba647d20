#!/usr/bin/env bash
# Create or update the virtual env, then run the test suite (offline, CPU only).
#   bash run_tests.sh           every test (what CI runs)
#   bash run_tests.sh --quick   the quick tier, before a commit: no test that starts processes (marker multiprocess),
#                               runs whole jobs (end_to_end) or takes long in-process (slow); see tests/README.md
# Extra arguments go to pytest, e.g.: bash run_tests.sh -k buckets
# The test files are shared among TEST_WORKERS pytest processes (default 2: on 2 cores the suite's work is
# CPU-bound, so two take less time than one; a worker and its warm launcher hold a few GB of memory), the
# longest files first (conftest.LONGEST_FILES; --no-loadscope-reorder keeps that order).
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
tier=()
if [ "${1:-}" = "--quick" ]; then
    shift
    tier=(-m "not multiprocess and not end_to_end and not slow")
    export QUICK_TIER=1  # conftest: no warm launcher, and a test that starts a process fails, naming the marker it needs
fi
bash create_venv.sh
export HF_HUB_OFFLINE=1
# The trainer's allocator settings (train.sh's) for every test process: the pytest workers, the ranks forked
# from them and the scripts they start: training-heavy tests take less CPU with them (tests/README.md, "What
# keeps it short").
source tools/allocator_settings.sh
exec "$VENV_DIR/bin/python" -m pytest tests -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "${tier[@]}" "$@"
