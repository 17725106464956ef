"""The Prefect flows and their entry points: the flow (pipeline.py), the command line (grpo.py,
`python -m grpo_pipeline --help`), the deployments' form (form.py) and serving it (serve.py), and what
a command-line run needs around its flow: Prefect's API (local_api.py), reaping what a killed run left
(lease.py), `--preflight` (node_check.py) and `--suggest-layout` (suggest.py)."""
