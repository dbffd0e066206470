"""Format versions of the outputs eaglet writes and later reads back, and the one check of them.

Each format carries its number under `KEY` ("format_version") in the file that describes it:

    manifest     <stage>/manifest.json                        MANIFEST_VERSION  (eaglet/pipeline.py)
    store        <extract>/store.json and index.json's meta   STORE_VERSION     (formats/store.py)
    checkpoint   <train>/checkpoints/step-*/state.json        CHECKPOINT_VERSION (formats/checkpoints.py)
    prepared     <prepare>/index.json                         PREPARED_VERSION  (formats/prepared.py)

The rule: an output whose number is not this eaglet's (or that has none: written before formats
had one) is refused by `check_version`, in one line that names its folder and the command that
writes it afresh. Nothing converts or reads an older format: eaglet is a 0.x tool, and a reader
that knows one layout per format is one a change can reason about. Raise a format's number when
a change makes its existing outputs unreadable or wrong to read as they are (a tensor renamed or
laid out otherwise, a file's meaning changed); a key added that readers do not need leaves it.
The formats are versioned apart so that a new checkpoint layout does not discard a store that
took hours to extract. The version is checked where the output is read, after its checksums; an
output that fails them is looked at for its version too (`recorded_version`), so that another
eaglet's output is refused as such, not reported as damaged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import FormatVersionError

KEY = "format_version"
MANIFEST_VERSION = 1
STORE_VERSION = 1
CHECKPOINT_VERSION = 1
PREPARED_VERSION = 1
UNREADABLE = object()  # `recorded_version` of a file that cannot say: left to the damage checks


def check_version(found: Any, want: int, what: str, folder: str | Path, fix: str) -> None:
    """Raise FormatVersionError unless `found` (a description's KEY value, None where it has none)
    is `want`. `what` names the output ("the store"), `folder` where it is, `fix` the command that
    writes it afresh. UNREADABLE passes (the file's damage is reported by its format)."""
    if found is UNREADABLE or found == want:
        return
    was = "has no format version (written before eaglet's formats had one)" if found is None \
        else f"is format version {found}"
    raise FormatVersionError(f"{what} in {folder} {was}; this eaglet reads version {want} and converts no other",
                             fix=fix)


def recorded_version(path: str | Path, *keys: str) -> Any:
    """The KEY value of JSON file `path` (inside the objects under `keys`), read without its
    checksum: None where it has none, UNREADABLE where it is no such JSON."""
    try:
        holder = json.loads(Path(path).read_text())
        for key in keys:
            holder = holder[key]
    except (OSError, ValueError, RecursionError, KeyError, TypeError, IndexError):
        return UNREADABLE
    return holder.get(KEY) if isinstance(holder, dict) else UNREADABLE
