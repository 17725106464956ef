"""One module per stage of the flow: plain functions that never import Prefect; tasks/stage_tasks.py
wraps each in a Prefect task. Beside them, what the first stages take and plan without Prefect: the
run request (request.py, its form rules in form_rules.py), the plan and its checks (plan.py) and the
run folder's lock (run_lock.py)."""
