"""The architecture of a model given by its hub repo id, read from the repo's own config.json.

    python -m grpo_pipeline --model Qwen/Qwen3-0.6B --device cpu --dry-run

Read only where no profile file or --set gives `model.architecture`. The file is kept in the model
store (`<model.root>/.hub-configs`, in the Hugging Face cache's layout), so a later plan of the same
model reads it offline; otherwise it is fetched, one small file, after the hub's first hop answers. A hub
that cannot be reached is one line with the ways around it, before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_pipeline.errors import ProfileError
from grpo_pipeline.profiles.hf_config import architecture_from_hf_config
from grpo_pipeline.store.hub_reach import hub_endpoint, hub_offline, reach_problem

CONFIG = "config.json"
CONFIGS_FOLDER = ".hub-configs"
# Seconds the hub may take to answer for one small file.
FETCH_TIMEOUT_S = 20.0


def is_repo_id(path: str) -> bool:
    """`org/name`, as the command line takes a hub model (a local directory is checked first)."""
    return "/" in path and not path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir()


def hub_architecture(repo: str, revision: str, model_root: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The architecture numbers of hub model `repo` at `revision` (profiles/hf_config.py), from the
    store's copy of its config.json or fetched into it."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    environ = os.environ if environ is None else environ
    cache = Path(model_root).expanduser() / CONFIGS_FOLDER
    kept = try_to_load_from_cache(repo, CONFIG, cache_dir=cache, revision=revision)
    if isinstance(kept, str):
        return architecture_from_hf_config(Path(kept).parent)
    what = f"--model {repo}: its {CONFIG} (the model's architecture, which the plan is checked against)"
    ways = "or give a local copy (--model /path/to/model-dir) or model.architecture.* in a profile file"
    endpoint = hub_endpoint(environ)
    if hub_offline(environ):
        raise ProfileError(f"{what} is not in {cache} and HF_HUB_OFFLINE is set: unset it to fetch it, {ways}")
    if problem := reach_problem(endpoint, environ):
        raise ProfileError(f"{what} cannot be fetched: {problem}; use a network that reaches {endpoint}, a mirror in "
                           f"HF_ENDPOINT, {ways}")
    try:
        fetched = hf_hub_download(repo, CONFIG, revision=revision, cache_dir=cache, endpoint=endpoint,
                                  etag_timeout=FETCH_TIMEOUT_S)
    except Exception as exc:  # the hub's answer, in the project's words (store/hub.py)
        from grpo_pipeline.store.hub import classify_hub_error

        raise ProfileError(f"{classify_hub_error(exc, what)}; {ways.removeprefix('or ')}") from None
    return architecture_from_hf_config(Path(fetched).parent)
