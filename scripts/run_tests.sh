#!/usr/bin/env bash
# Sets up .venv with everything the tests need, then runs the whole test suite.
# Extra arguments go to pytest (e.g. scripts/run_tests.sh -k image_folder).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
toolkit_env "pipelines,tf,grain,xla,test"
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
