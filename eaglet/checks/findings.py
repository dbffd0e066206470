"""What the checks find: one line each, and the facts they pass on.

The doctor (eaglet/doctor.py) and its vLLM checks (eaglet/engines/vllm/checks.py) add a
`Finding` per check to a `Probe`; a stage's preflight raises `PreflightError` with the FAIL
lines, or, when every FAIL is the user's own input error (a folder not found), that error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import Config
from ..errors import EagletError

# (status, check, expected, found, fix): one finding of a further check, printed as it comes
Report = Callable[[str, str, str, str, str], None]


@dataclass
class Finding:
    status: str  # "ok" | "info" | "warn" | "FAIL"
    check: str
    expected: str
    found: str
    fix: str = ""
    # The user's own error behind a FAIL (a missing file or folder, a bad value), as the stage
    # itself would raise it: the preflight raises it as it is (its message, its exit code).
    error: EagletError | None = None

    def line(self) -> str:
        text = f"{self.status:<4}  {self.check}: expected {self.expected}; found {self.found}"
        return text + (f"; fix: {self.fix}" if self.fix and self.status in ("warn", "FAIL") else "")


@dataclass
class Probe:
    """What the checks learn about the target, passed from one check to the next."""

    cfg: Config
    stage: str | None  # None: the doctor (every check)
    findings: list[Finding] = field(default_factory=list)
    hf_config: Any = None
    text_config: Any = None
    tokenizer: Any = None
    template: str | None = None
    model: Any = None  # meta-device skeleton
    draft: Any = None  # (text config, the draft training builds from it on the meta device), once known
    parts: Any = None  # TargetParts of the skeleton
    layers: list[int] | None = None
    sampled: list[dict[str, Any]] = field(default_factory=list)  # per data file: records read, tokens, bytes
    vllm_ready: bool = False  # a vLLM new enough is importable here, to extract or evaluate (its rows are checked)
    vllm_roles: dict[str, list[type]] = field(default_factory=dict)  # {vllm_model}: the target's vLLM class

    def add(self, status: str, check: str, expected: str, found: str, fix: str = "",
            error: EagletError | None = None) -> None:
        self.findings.append(Finding(status, check, expected, found, fix, error))
