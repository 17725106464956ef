"""TensorBoard as a run's tracker: its settings, its folder of event files, written through torch's `SummaryWriter`."""

from __future__ import annotations

import shutil
from pathlib import Path

from pydantic import Field

from grpo_pipeline.profiles.section import Section
from grpo_pipeline.profiles.trackers.base import Tracker


class TensorboardSettings(Section):
    log_dir: str | None = Field(
        None, description="Folder of the event files (shared storage for the verl backend); empty: "
        "`<run folder>/tensorboard`.")


class TensorboardTracker(Tracker):
    """Event files through torch's `SummaryWriter`, the writer verl's TensorBoard logger uses; a session
    adds a file, and TensorBoard's reader shows the folder as one run."""

    # verl's TensorBoard logger writes through torch's SummaryWriter, which needs the tensorboard package.
    name = verl_logger = "tensorboard"
    label, settings_class = "TensorBoard", TensorboardSettings
    package, imports = "tensorboard", ("torch.utils.tensorboard",)
    local_ui = "http://localhost:6006"  # where `tensorboard` serves a folder by default
    folder = "tensorboard"  # in the run's folder (RunFolder.TENSORBOARD reads it), unless the profile names one

    def __init__(self, settings: TensorboardSettings, run_dir: Path):
        super().__init__(settings, run_dir)
        self.log_dir = Path(settings.log_dir).expanduser().resolve() if settings.log_dir else (
            self.run_dir.resolve() / self.folder)

    def where(self):
        return str(self.log_dir)

    def open(self, ids, run_name):
        from torch.utils.tensorboard import SummaryWriter

        if ids:
            self.log_dir = Path(ids["log_dir"])
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.log_dir))
        return {"log_dir": str(self.log_dir)}

    def link(self):
        return f"{self.local_ui} (once `.venv/bin/tensorboard --logdir {self.log_dir}` serves it)"

    def log_params(self, params, tags):
        # TensorBoard has no parameters: the profile and the tags are text, shown in its TEXT tab.
        self.writer.add_text("tags", "\n".join(f"- {k}: {v}" for k, v in tags.items()))
        if params:
            self.writer.add_text("profile", "\n".join(f"    {k}: {v}" for k, v in params.items()))

    def log_metrics(self, metrics, step):
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def log_file(self, path):
        path = Path(path)
        if path.suffix in (".md", ".txt"):
            self.writer.add_text(path.stem, path.read_text())
        (self.log_dir / "files").mkdir(exist_ok=True)
        shutil.copy2(path, self.log_dir / "files" / path.name)

    def close(self, status=None):
        self.writer.close()

    def job_env(self, ids):
        return {"TENSORBOARD_DIR": ids["log_dir"]}
