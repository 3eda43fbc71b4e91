"""Save the resolved config of a ``lightning-fastdist`` run without ever replacing a file we did not write.

Without a logger LightningCLI saves ``config.yaml`` into the working directory and then either refuses to start
(a config is there) or, with ``overwrite``, replaces whatever file is there. We mark our files with a first line
(``MARKER``) and replace only those; another file is kept, the config is not saved, and rank 0 says so.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from fsspec import AbstractFileSystem
from jsonargparse import Namespace
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback
from typing_extensions import override

MARKER = "# Resolved config of a lightning-fastdist run; the next run that saves its config here replaces this file."


def written_by_us(fs: AbstractFileSystem, path: str) -> bool:
    """Whether the file at ``path`` starts with ``MARKER`` (a config this module wrote)."""
    if not fs.isfile(path):
        return False
    with fs.open(path, "rb") as file:
        return file.readline().rstrip(b"\n") == MARKER.encode()


class OwnConfigSaver(SaveConfigCallback):
    """Write the resolved config to ``<log_dir>/config.yaml`` (rank 0), replacing only a config it wrote itself.

    After ``setup``, ``saved_to`` is the file written, or ``None`` (then ``not_saved_because`` says why, if a file
    was in the way).
    """

    def __init__(self, parser: LightningArgumentParser, config: Namespace, **kwargs: Any) -> None:
        super().__init__(parser, config, **kwargs)
        self.saved_to: str | None = None
        self.not_saved_because = ""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir  # a broadcast: every rank takes part
        if trainer.is_global_zero and log_dir is not None:
            self._save(log_dir)
        self.already_saved = True

    def _save(self, log_dir: str | os.PathLike) -> None:
        fs = get_filesystem(log_dir)
        path = os.path.join(log_dir, self.config_filename)
        if fs.exists(path) and not written_by_us(fs, path):
            self.not_saved_because = f"{path} exists and was not written by lightning-fastdist"
            print(
                f"lightning-fastdist: the resolved config was not saved: {self.not_saved_because}, "
                "so it was left as it is (a logger or --trainer.default_root_dir puts the config elsewhere).",
                file=sys.stderr,
            )
            return
        fs.makedirs(str(log_dir), exist_ok=True)
        with fs.open(path, "w") as file:
            file.write(MARKER + "\n" + self.parser.dump(self.config, skip_none=False))
        self.saved_to = path
