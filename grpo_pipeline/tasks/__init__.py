"""Each stage as a Prefect task (stage_tasks.py) and how Prefect runs them (policy.py), with what a
flow run keeps while they run (run_record.py) and logs to its trackers (tracking.py); the flows of
flows/ chain these tasks, and each task calls the plain functions of stages/.
"""
