#!/usr/bin/env bash
# Sets up .venv with everything the tests need, then runs the whole test suite.
# Extra arguments go to pytest (e.g. scripts/run_tests.sh -k image_folder).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh

# A real DICOM store for the DICOMweb tests (tests/orthanc.py): Debian's Orthanc and its DICOMweb plugin.
orthanc_packages() {
  [ -e /usr/share/orthanc/plugins/libOrthancDicomWeb.so ] && return 0
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq orthanc orthanc-dicomweb >/dev/null || true
  fi
  [ -e /usr/share/orthanc/plugins/libOrthancDicomWeb.so ] || { echo "error: orthanc and orthanc-dicomweb are needed" \
    "(apt-get install orthanc orthanc-dicomweb, as root)" >&2; return 1; }
}
# Airflow lives in its own venv (its pins differ from TensorFlow's and torch_xla's needs).
airflow_env() {
  new_venv .venv-airflow 3 && venv_install .venv-airflow/bin/python -c constraints-airflow.txt -e ".[airflow]" pytest
}

# The three set-ups overlap (downloads, unpacking and apt each leave the other cores idle).
orthanc_packages & orthanc_pid=$!
airflow_env & airflow_pid=$!
trap 'kill "$orthanc_pid" "$airflow_pid" 2>/dev/null || true' EXIT
toolkit_env "pipelines,tf,grain,xla,graph,jax,test"
wait "$airflow_pid" || { echo "error: could not set up .venv-airflow" >&2; exit 1; }
wait "$orthanc_pid" || exit 1
trap - EXIT

# suite PYTEST...: runs one suite; collecting no tests is a failure.
suite() {
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests ($*)" >&2
    rc=1
  fi
  return "$rc"
}

# The Airflow suite runs beside the main one, its output held until the main suite's ends. The main suite runs
# on TEST_WORKERS pytest-xdist workers (default 2: CI's cores), test by test, except that the tests sharing a
# module's fixture run on one worker (tests/conftest.py groups them); TEST_WORKERS=0 runs it in this process.
# It ends with its 20 slowest tests.
airflow_log="$(mktemp)"
suite .venv-airflow/bin/python -m pytest tests/airflow "$@" >"$airflow_log" 2>&1 & airflow_tests_pid=$!
trap 'kill "$airflow_tests_pid" 2>/dev/null || true; rm -f "$airflow_log"' EXIT
main_rc=0 airflow_rc=0
suite .venv/bin/python -m pytest tests -n "${TEST_WORKERS:-2}" --dist loadgroup --durations=20 "$@" || main_rc=$?
wait "$airflow_tests_pid" || airflow_rc=$?
echo "--- the Airflow suite (tests/airflow, .venv-airflow):"
cat "$airflow_log"
[ "$main_rc" -eq 0 ] || exit "$main_rc"
exit "$airflow_rc"
