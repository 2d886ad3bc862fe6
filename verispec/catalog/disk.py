"""Where the model cache lives on disk and how it is written safely: its layout, what counts as installed, the
per-model lock, and the work directories that make every write all-or-nothing.

Layout under $VERISPEC_HOME (default ~/.cache/verispec):
    models/NAME/model.gguf       the assembled, SHA-256-verified GGUF (what llama.cpp runs)
    models/NAME/tokenizer/       its tokenizer and chat template as a Hugging Face tokenizer (what llama.cpp's
                                 text path needs besides the GGUF; seconds to extract)
    models/NAME/hf/              a Hugging Face directory (bf16 safetensors + tokenizer) for transformers, converted
                                 from the GGUF on first use (a minute or more) or by `pull(..., weights=True)`
    models/NAME/manifest.json    the SHA-256 of every file; a model directory without it is never trusted
    tmp/                         work in progress; renamed into models/ only when complete and verified
    locks/NAME.lock              held (flock) by the one pull or conversion of NAME that may run at a time

Nothing under models/ is ever written in place: an interrupted or failed pull or conversion leaves the cache as it
was (a model's directory appears whole, as does its hf/ directory, each by one rename).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from verispec.names.errors import ModelError

GGUF_NAME = "model.gguf"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
HF_DIR = "hf"

Progress = Callable[[str, int, int], None]  # (stage, done, total)

log = logging.getLogger("verispec")


def no_progress(stage: str, done: int, total: int) -> None:
    pass


def cache_root() -> Path:
    return Path(os.environ.get("VERISPEC_HOME") or Path.home() / ".cache" / "verispec")


def model_dir(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / name


def installed(name: str, root: Path | None = None) -> Path | None:
    """The model's directory if it is completely installed (manifest present), else None."""
    path = model_dir(name, root)
    return path if (path / MANIFEST).is_file() else None


def sha256_file(path: Path, progress: Progress = no_progress, stage: str = "hash") -> str:
    digest = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            done += len(block)
            progress(stage, done, total)
    return digest.hexdigest()


def file_hashes(model: Path, sub: str) -> dict[str, str]:
    """SHA-256 of every file under model/sub, keyed by its path relative to model."""
    return {str(p.relative_to(model)): sha256_file(p) for p in sorted((model / sub).rglob("*")) if p.is_file()}


class PullLock:
    """An exclusive lock on one model's pull or conversion (locks/NAME.lock, flock: released by the OS when the
    process dies). A second pull of the same model fails at once with one line instead of racing the first; a
    conversion on first use (`wait`) waits for the other to finish."""

    def __init__(self, root: Path, name: str, wait: bool = False) -> None:
        (root / "locks").mkdir(parents=True, exist_ok=True)
        self.path = root / "locks" / f"{name}.lock"
        self.name = name
        self.wait = wait
        self._fd: int | None = None

    def __enter__(self) -> PullLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not self.wait:
                os.close(fd)
                raise ModelError(f"another pull of {self.name} is running; wait for it to finish") from None
            log.warning("verispec: waiting for another process preparing %s", self.name)
            fcntl.flock(fd, fcntl.LOCK_EX)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _clean_stale(tmp_root: Path, name: str) -> None:
    """Remove work directories of this model left by pulls that were killed (owner process gone)."""
    for path in tmp_root.glob(f"{name}.*"):
        pid = path.name.split(".")[-2] if path.name.count(".") >= 2 else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is the filesystem running out of space. Libraries that write
    files (safetensors, zipfile) wrap the OSError or only keep its message."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _check_disk(path: Path, name: str, need: int) -> None:
    free = shutil.disk_usage(path).free
    if free < need:
        raise ModelError(f"not enough disk space for {name}: need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")


def in_work_dir(root: Path, name: str, need: int, what: str, work_fn: Callable[[Path], None]) -> None:
    """Run work_fn(work) in a fresh directory under tmp/, removed afterwards whatever happens; a full disk becomes
    one line."""
    tmp_root = root / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    _clean_stale(tmp_root, name)
    _check_disk(tmp_root, name, need)
    work = Path(tempfile.mkdtemp(prefix=f"{name}.{os.getpid()}.", dir=tmp_root))
    try:
        work_fn(work)
    except Exception as exc:
        if _disk_full(exc):
            raise ModelError(f"the disk holding {root} filled up while {what} {name}; "
                             f"free ~{need / 2**30:.1f} GiB and try again") from exc
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
