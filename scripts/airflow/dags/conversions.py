"""Airflow DAG file: one scheduled conversion DAG per JSON config.

Put this folder in Airflow's dags folder (or point `dags_folder` at it). Configs
are read from $TOOLKIT_DAG_CONFIGS, else from `configs/` beside this file; see
scheduling/airflow_dags.py for the format.
"""

import os

from scheduling.airflow_dags import dags_from_folder

_CONFIGS = os.environ.get("TOOLKIT_DAG_CONFIGS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"))

globals().update(dags_from_folder(_CONFIGS))
