"""The Prefect flow and the command line: `python -m flows.grpo --help`."""
