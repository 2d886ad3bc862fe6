"""The package's layers: every import inside verispec points down (or within its layer), never up.

names -> catalog (both torch-free) -> core -> backends -> proposers -> decoding -> pipeline -> assembly -> apps,
then the public facade (verispec/__init__.py, verispec/chat.py) over them all. Every import counts: module-level,
inside a function, under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "verispec"
LAYERS = ["names", "catalog", "core", "backends", "proposers", "decoding", "pipeline", "assembly", "apps"]
FACADE = len(LAYERS)  # verispec/__init__.py and the top-level modules that keep public paths


def layer_of(module: str) -> int:
    """The layer of a dotted verispec module name."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return FACADE


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a verispec module in a file; `from verispec import x` counts as
    importing verispec.x when that is a module, else verispec itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "verispec"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "verispec":
                for a in node.names:
                    sub = PACKAGE / a.name
                    found.append((node.lineno, f"verispec.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists()
                                  else "verispec"))
            elif node.module.split(".")[0] == "verispec":
                found.append((node.lineno, node.module))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_sits_in_a_layer():
    assert [d.name for d in PACKAGE.iterdir() if d.is_dir() and d.name != "__pycache__"] and all(
        (PACKAGE / name).is_dir() for name in LAYERS)
    facade = sorted(module_name(p) for p in SOURCES if layer_of(module_name(p)) == FACADE)
    assert facade == ["verispec", "verispec.chat"]  # public paths only: a new module belongs in a layer


def upward_imports(path: Path, module: str) -> list[str]:
    """The imports in `path` (the source of `module`) that reach a higher layer."""
    own = layer_of(module)
    return [f"line {line}: {name} ({LAYERS[layer_of(name)] if layer_of(name) < FACADE else 'facade'})"
            for line, name in imports(path) if layer_of(name) > own]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down(path):
    upward = upward_imports(path, module_name(path))
    assert not upward, f"{module_name(path)} imports up: {upward}"


TORCH_FREE = sorted((PACKAGE / "names").rglob("*.py")) + sorted((PACKAGE / "catalog").rglob("*.py"))


@pytest.mark.parametrize("path", TORCH_FREE, ids=lambda p: module_name(p))
def test_names_and_catalog_are_torch_free(path):
    """Parsing a command line or listing models needs no torch: the names and catalog layers import none at module
    level."""
    tree = ast.parse(path.read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    heavy = [ast.unparse(n) for n in top if any(
        name.split(".")[0] in ("torch", "transformers", "numpy")
        for name in ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]))]
    assert not heavy, heavy


def test_the_check_catches_an_upward_import(tmp_path):
    """A core module importing the engine, even inside a function, is reported: the check can fail."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from verispec.decoding.engine import SpeculativeEngine\n")
    assert upward_imports(probe, "verispec.core.probe") == ["line 2: verispec.decoding.engine (decoding)"]
    assert upward_imports(probe, "verispec.apps.probe") == []


def test_the_library_imports_without_transformers():
    """`import verispec` and the layers below assembly load no transformers (nor llama_cpp): the command line's
    light paths and a user of the engine alone do without it; the backends that need it import it when used."""
    import subprocess
    import sys

    code = ("import sys, verispec, verispec.decoding.engine, verispec.pipeline.pipeline, verispec.proposers; "
            "print(sorted(m for m in ('transformers', 'llama_cpp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_assembly_imports_no_transformers_model_code():
    """Building a pipeline (verispec.assembly) imports transformers' model code only when a transformers model is
    loaded: a llama.cpp pipeline needs its tokenizers, not the seconds that model code takes to import."""
    import subprocess
    import sys

    code = ("import sys, verispec.apps.cli.generate, verispec.apps.server.app, verispec.apps.bench.harness; "
            "print(sorted(m for m in ('transformers.modeling_utils', 'verispec.backends.hf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
