"""The errors a user can cause and fix, and the `eaglet` command's exit codes.

Each is raised with what went wrong and where (the file, record, setting or folder), and
how to fix it; the command prints it as one line, `eaglet: <what>, <where>; <how to fix>`,
and exits with the class's code. Anything else that escapes a stage is a bug or a library
change eaglet did not foresee: one line too (exit 70), the traceback only with `--debug`
(or EAGLET_DEBUG=1).

    0    done
    1    `eaglet doctor` found a FAIL
    2    ConfigError         a config key or value
    3    PreflightError      a stage's cheap checks failed before it loaded weights
    4    InputError          an input file, folder or record; a stage run before the one it needs;
                             FormatVersionError: an output of another eaglet format version
    5    CorruptDataError    a file eaglet wrote is damaged (a store shard, a checkpoint)
    6    ResumeError         resuming would mix two runs
    7    VerificationError   eaglet's own check of a result failed: the extraction self-check
                             (stored states against the model's forward), eval's lossless check;
                             DivergedError: training's gradient norm not finite for more than
                             train.max_skipped_steps steps in a row, or its weights not finite
    70   any other exception (a bug: report it)
    130  interrupted (Ctrl-C): rerun the same command to resume
"""

from __future__ import annotations

EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


class EagletError(Exception):
    """An error the user can fix. `fix` (how) is appended to the message after '; '."""

    exit_code = 4

    def __init__(self, message: str, fix: str | None = None):
        self.message, self.fix = message, fix
        super().__init__(f"{message}; {fix}" if fix else message)

    def line(self) -> str:
        """The message as one line (a multi-line message is joined with '; ')."""
        return one_line(str(self))


class ConfigError(EagletError, ValueError):
    """A config key or value is invalid. The message names the key."""

    exit_code = 2


class PreflightError(EagletError):
    """A stage's preflight checks failed before any weights loaded."""

    exit_code = 3


class InputError(EagletError):
    """An input file, folder or record cannot be used, or a stage runs before one it needs."""

    exit_code = 4


class FormatVersionError(InputError):
    """An output eaglet wrote (a manifest, a store, a checkpoint, prepared data) is of another
    format version than this eaglet reads (eaglet/formats/version.py): it is not converted; the
    message names the folder and the command that writes it afresh."""


class CorruptDataError(EagletError, RuntimeError):
    """A file eaglet wrote does not match its checksum or its description."""

    exit_code = 5


class ResumeError(EagletError, RuntimeError):
    """Resuming would mix two runs (settings or inputs changed since the checkpoint)."""

    exit_code = 6


class VerificationError(EagletError, RuntimeError):
    """A result disagrees with its reference (states with the model's own forward, speculative
    output with the target's greedy output): nothing downstream may use it."""

    exit_code = 7


class DivergedError(VerificationError):
    """Training diverged: the gradient norm was not finite for more steps in a row than
    train.max_skipped_steps allows, or a weight is not finite; no checkpoint or final draft of
    it is written."""


def one_line(text: str) -> str:
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())
