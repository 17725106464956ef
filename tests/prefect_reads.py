"""What a run left in Prefect's API, read back as the UI reads it (the session's API holds every test's runs)."""

from __future__ import annotations

import asyncio

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey


def artifacts(keys: list[str] | None, flow_run_id=None) -> list:
    """The artifacts of these keys (all where None), of one flow run where given, oldest first: a stage the flow
    retried has each attempt's progress bar under its key, the newest last."""
    async def read():
        runs = {"flow_run_id": ArtifactFilterFlowRunId(any_=[flow_run_id])} if flow_run_id else {}
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys), **runs) if keys or runs else None)

    return sorted(asyncio.run(read()), key=lambda a: a.created)
