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
