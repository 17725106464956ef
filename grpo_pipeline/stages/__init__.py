"""One module per stage of the flow: plain functions that never import Prefect; tasks/stage_tasks.py
wraps each in a Prefect task."""
