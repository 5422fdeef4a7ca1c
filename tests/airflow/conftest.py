"""Airflow tests run in their own virtual environment (.venv-airflow, set up by
scripts/run_tests.sh) with a throw-away Airflow home and SQLite database."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

_HOME = tempfile.mkdtemp(prefix="airflow-home-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)  # after the session, whatever its end
os.environ.update({
    "AIRFLOW_HOME": _HOME,
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_HOME}/airflow.db",
    "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(_HOME, "dags"),
})
subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, timeout=600)
