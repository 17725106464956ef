"""One module per stage of the flow; plain functions do the work, `flows/pipeline.py` wraps them."""
