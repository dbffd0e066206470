"""What a stage function receives besides the config (eaglet/pipeline.py runs the stages)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StageContext:
    """What a stage function receives besides the config."""

    name: str
    out_dir: Path  # this stage's folder (exists)
    run_dir: Path
    input_hash: str
    upstream: dict[str, Path] = field(default_factory=dict)  # earlier stages' folders by name
    # `--force`: redo the stage. train starts fresh (the old run is kept aside); extract
    # verifies every shard of the store and re-extracts the samples of bad or missing ones.
    force: bool = False
    # `eaglet train --extend`: continue a run to a longer schedule (train.epochs or
    # train.max_steps raised), see the train stage.
    extend: bool = False
