"""Scheduled conversions: Airflow DAGs that run the converters of `pipelines.registry`.

Kept apart from `pipelines` (the Beam package): a scheduler loads this in its
own environment and reads only the registry, never the converters' code.
"""
