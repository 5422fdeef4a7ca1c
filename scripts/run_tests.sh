#!/usr/bin/env bash
# Sets up .venv with everything the tests need, then runs the whole test suite.
# Extra arguments go to pytest (e.g. scripts/run_tests.sh -k image_folder).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
toolkit_env "pipelines,tf,grain,xla,graph,test"
# Airflow lives in its own venv (its pins differ from TensorFlow's and torch_xla's needs).
if [ ! -x .venv-airflow/bin/python ]; then
  warn_low_disk 3
  "$(ls .venv/bin/python3.11 2>/dev/null || echo python3)" -m venv .venv-airflow
fi
.venv-airflow/bin/python -m pip install --quiet --upgrade pip
pip_install .venv-airflow/bin/python -c constraints-airflow.txt -e ".[airflow]" pytest

status=0
for suite in ".venv/bin/python -m pytest tests" ".venv-airflow/bin/python -m pytest tests/airflow"; do
  set +e
  $suite "$@"
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests ($suite)" >&2
    rc=1
  fi
  [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
