"""The Prefect flow and the command line: `python -m grpo_pipeline --help`."""
