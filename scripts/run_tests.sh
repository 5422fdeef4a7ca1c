#!/usr/bin/env bash
# Sets up .venv with everything the tests need, then runs the whole test suite.
# Extra arguments go to pytest (e.g. scripts/run_tests.sh -k image_folder).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
# Airflow lives in its own venv (its pins differ from TensorFlow's and torch_xla's needs), installed beside the
# main one: the two installs overlap.
airflow_env() {
  new_venv .venv-airflow 3 && venv_install .venv-airflow/bin/python -c constraints-airflow.txt -e ".[airflow]" pytest
}
airflow_env &
airflow_pid=$!
trap 'kill "$airflow_pid" 2>/dev/null || true' EXIT
toolkit_env "pipelines,tf,grain,xla,graph,jax,test"
# A real DICOM store for the DICOMweb tests (tests/orthanc.py): Debian's Orthanc and its DICOMweb plugin.
if [ ! -e /usr/share/orthanc/plugins/libOrthancDicomWeb.so ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq orthanc orthanc-dicomweb >/dev/null || true
  fi
  [ -e /usr/share/orthanc/plugins/libOrthancDicomWeb.so ] || { echo "error: orthanc and orthanc-dicomweb are needed" \
    "(apt-get install orthanc orthanc-dicomweb, as root)" >&2; exit 1; }
fi
wait "$airflow_pid" || { echo "error: could not set up .venv-airflow" >&2; exit 1; }
trap - EXIT

# The main suite runs on TEST_WORKERS pytest-xdist workers (default 2: CI's cores), test by test, except that
# the tests sharing a module's fixture run on one worker (tests/conftest.py groups them); TEST_WORKERS=0 runs it
# in this process.
status=0
for suite in ".venv/bin/python -m pytest tests -n ${TEST_WORKERS:-2} --dist loadgroup" \
             ".venv-airflow/bin/python -m pytest tests/airflow"; do
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
