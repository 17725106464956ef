"""One module per stage of the flow: plain functions that never import Prefect; tasks/stage_tasks.py
wraps each in a Prefect task. The first is the plan (plan.py): the planning stages and their checks,
what the dry run runs."""
