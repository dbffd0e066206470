"""bench/vllm_payload.sh and bench/device.sh's dev_vllm_part / dev_vllm on the CPU, with two small
wheels standing in for vLLM's set: the tar is cut into parts under the limit, the same on a second
build; each simulated device call moves its part to $DEV/V; dev_vllm names a part not yet carried or
one that differs from SHA256SUMS in one line and returns non-zero, and once all are there installs the
wheels into $DEV/site, where `from vllm import LLM, SamplingParams` imports."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PART_BYTES = 100_000


def make_wheel(folder: Path, name: str, files: dict[str, bytes]) -> None:
    """A minimal wheel NAME-1.0 holding `files`, that pip installs with --no-index --no-deps."""
    info = f"{name}-1.0.dist-info"
    entries = dict(files)
    entries[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()
    entries[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    entries[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*entries, f"{info}/RECORD"]).encode()
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w", zipfile.ZIP_STORED) as wheel:
        for path, data in entries.items():
            wheel.writestr(path, data)


def repo_copy(tmp_path: Path) -> Path:
    """A folder laid out as the repository for the two scripts (they work from its root)."""
    root = tmp_path / "repo"
    (root / "bench").mkdir(parents=True)
    for script in ("vllm_payload.sh", "device.sh"):
        shutil.copy(REPO / "bench" / script, root / "bench" / script)
    return root


def bash(root: Path, command: str, dev: Path) -> subprocess.CompletedProcess:
    """`command` run by bash from `root` with bench/device.sh sourced, as a device call runs it."""
    env = dict(os.environ, DEV=str(dev), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.pop("VLLM_USE_FLASHINFER_SAMPLER", None)
    return subprocess.run(["bash", "-c", f"source bench/device.sh; {command}"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_parts_carried_one_a_call_then_installed(tmp_path):
    root, dev, wheels = repo_copy(tmp_path), tmp_path / "dev", tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "vllm", {"vllm/__init__.py": b"LLM = SamplingParams = object\n"})
    noise = random.Random(0).randbytes(3 * PART_BYTES)  # incompressible: the tar is over three parts
    make_wheel(wheels, "ballast", {"ballast/data.bin": noise})
    env = dict(os.environ, VLLM_PART_BYTES=str(PART_BYTES))
    build = subprocess.run(["bash", str(root / "bench" / "vllm_payload.sh"), str(wheels)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    vset = root / ".whl-vllm" / "vllm"
    parts = sorted(p.name for p in vset.glob("vllm-set.part-*"))
    assert parts == ["vllm-set.part-aa", "vllm-set.part-ab", "vllm-set.part-ac", "vllm-set.part-ad"]
    assert all((vset / p).stat().st_size <= PART_BYTES for p in parts)
    assert "4 parts" in build.stdout
    sums = (vset / "SHA256SUMS").read_text()
    assert [line.split()[1] for line in sums.splitlines()] == parts
    time.sleep(1.1)  # a second build a second later: the tar holds no file times
    rebuild = subprocess.run(["bash", str(root / "bench" / "vllm_payload.sh"), str(wheels)], env=env,
                             capture_output=True, text=True, timeout=300)
    assert rebuild.returncode == 0 and (vset / "SHA256SUMS").read_text() == sums  # parts carried stay valid

    # Each device call carries one part; the last (part-ad) has not come yet.
    carried = {p: (vset / p).read_bytes() for p in parts}
    (vset / "vllm-set.part-ad").unlink()
    for part in parts[:-1]:
        assert bash(root, f"dev_vllm_part {part}", dev).returncode == 0
        assert (dev / "V" / part).exists() and not (vset / part).exists()
    early = bash(root, "dev_vllm", dev)
    assert early.returncode != 0
    assert early.stdout.strip().splitlines() == [early.stdout.strip()] and "vllm-set.part-ad" in early.stdout
    assert not (dev / "site").exists()

    # A part that arrived damaged is named, and nothing is installed.
    damaged = bytearray(carried["vllm-set.part-ab"])
    damaged[10] ^= 1
    (dev / "V" / "vllm-set.part-ab").write_bytes(bytes(damaged))
    (vset / "vllm-set.part-ad").write_bytes(carried["vllm-set.part-ad"])
    bad = bash(root, "dev_vllm", dev)
    assert bad.returncode != 0 and "vllm-set.part-ab" in bad.stdout and "part-aa" not in bad.stdout
    assert len(bad.stdout.strip().splitlines()) == 1 and not (dev / "site").exists()

    # Carried again, then the set is whole: joined, installed, importable, the FlashInfer sampler off.
    (vset / "vllm-set.part-ab").write_bytes(carried["vllm-set.part-ab"])
    assert bash(root, "dev_vllm_part vllm-set.part-ab", dev).returncode == 0
    done = bash(root, 'dev_vllm && echo "sampler=$VLLM_USE_FLASHINFER_SAMPLER"', dev)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sampler=0" in done.stdout
    assert (dev / "site" / "ballast" / "data.bin").read_bytes() == noise
    assert (dev / "site" / "vllm" / "__init__.py").exists()

    # A later call finds it installed and carries nothing.
    again = bash(root, "dev_vllm && python3 -c 'from vllm import LLM, SamplingParams; print(\"ok\")'", dev)
    assert again.returncode == 0 and again.stdout.strip().endswith("ok")
