"""Weights & Biases as a run's tracker: its settings, its key (checked at planning), its run through `wandb.init`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from grpo_pipeline.profiles.section import Section
from grpo_pipeline.profiles.trackers.base import FINISHED, Tracker


class WandbSettings(Section):
    project: str = Field("grpo-pipeline", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); empty: the key's default entity.")
    mode: Literal["online", "offline"] = Field(
        "online", description="`online` sends the run to W&B (WANDB_API_KEY must be exported where the flow runs, "
        "and on every node for the verl backend); `offline` writes it under the run folder for `wandb sync`.")


class WandbTracker(Tracker):
    """`wandb.init(id=..., resume="allow")`: each session attaches to the run by its id (offline: a folder
    per session under the run folder's `wandb/`, which `wandb sync` joins into the one run)."""

    name = verl_logger = "wandb"
    label, settings_class = "Weights & Biases", WandbSettings
    package, imports = "wandb", ("wandb",)

    def where(self):
        return f"project {self.settings.project}, {self.settings.mode}"

    def open(self, ids, run_name):
        import wandb

        w = self.settings
        if missing := self.missing_credentials(w, os.environ):
            raise RuntimeError(missing)
        self.run = wandb.init(
            project=w.project, entity=w.entity, id=(ids or {}).get("run_id"), name=run_name, resume="allow",
            mode=w.mode, dir=str(self.run_dir), reinit="create_new",
            settings=wandb.Settings(init_timeout=60, silent=True, console="off", x_disable_stats=True))
        return {"run_id": self.run.id, "project": w.project, "entity": w.entity or "", "mode": w.mode,
                "dir": str(self.run_dir)}

    def link(self):
        if self.settings.mode == "online":
            return self.run.url or ""
        folder = self.run_dir / "wandb"  # where wandb.init(dir=<run folder>) writes
        return f"offline run {self.run.id} in {folder} (`wandb sync {folder}/offline-run-*`)"

    def log_params(self, params, tags):
        self.run.config.update({**params, **{f"tags/{k}": v for k, v in tags.items()}}, allow_val_change=True)
        # W&B's tags are short labels (64 characters at most).
        self.run.tags = tuple(sorted({*self.run.tags, *(f"{k}:{v}"[:64] for k, v in tags.items() if "url" not in k)}))

    def log_metrics(self, metrics, step):
        self.run.log(dict(metrics), step=step)

    def log_file(self, path):
        self.run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def close(self, status=None):
        self.run.finish(exit_code=0 if status in (None, FINISHED) else 1)

    def job_env(self, ids):
        env = {"WANDB_RUN_ID": ids["run_id"], "WANDB_RESUME": "allow", "WANDB_MODE": ids["mode"],
               "WANDB_DIR": ids["dir"]}
        return env | ({"WANDB_ENTITY": ids["entity"]} if ids.get("entity") else {})

    @classmethod
    def missing_credentials(cls, settings, environ):
        """W&B online without a key (WANDB_API_KEY, or `wandb login`'s netrc entry)."""
        if settings.mode == "online" and not environ.get("WANDB_API_KEY") and not _netrc_has_wandb():
            return ("tracking: W&B (online) needs WANDB_API_KEY, which is not set here (nor `wandb login`); export it, "
                    "or --set tracking.wandb.mode=offline")
        return None

    @classmethod
    def verl_project(cls, settings):
        # verl passes `trainer.project_name` to `wandb.init(project=...)`.
        return settings.project


def _netrc_has_wandb() -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False
