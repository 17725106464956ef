"""The Prefect flows and their entry points: the flow (pipeline.py), the command line (grpo.py,
`python -m grpo_pipeline --help`), the deployments' form (form.py) and serving it (serve.py)."""
