"""grpo-pipeline: GRPO post-training as a Prefect flow; `python -m grpo_pipeline --help`.

One installed name, so that nothing of the project collides with a same-named package on a user's
path or a cluster's image (docs/layout.md): the folders below are the design card's, one level down,
each on its floor (docs/layout.md draws them: `flows/` > `tasks/` > `stages/` > `backends/` > ... >
`profiles/` > `store/`, and `errors.py`, `progress.py` below them all). Importing this package imports nothing else, so the command line's dry
run stays fast.
"""
