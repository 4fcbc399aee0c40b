"""The layout's one rule: the library never imports the command layer (``diffusion3d/commands/``)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.helpers import ROOT, subprocess_env

PACKAGE = ROOT / "diffusion3d"
COMMAND_FILES = {PACKAGE / "__main__.py"} | set((PACKAGE / "commands").rglob("*.py"))


def library_modules() -> list[str]:
    """Dotted names of every library module (everything but commands/ and __main__)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in COMMAND_FILES:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_modules(path, module: str) -> set[str]:
    """Every module a file imports, relative imports resolved against its own package, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def test_library_source_never_imports_a_command():
    """Static: no library file names diffusion3d.commands or __main__ in any import, top level or inside a
    function (a lazy import is still an arrow pointing up)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in COMMAND_FILES:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        bad = sorted(
            m for m in imported_modules(path, module) if m.startswith(("diffusion3d.commands", "diffusion3d.__main__"))
        )
        offenders += [f"{path.relative_to(ROOT)} imports {m}" for m in bad]
    assert not offenders, offenders


def test_the_check_sees_an_upward_import(tmp_path):
    """The static check is not vacuous: a relative import of the command helper is recognised."""
    fake = PACKAGE / "evaluation" / "x.py"
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from ..commands.common import InputError\n")
    assert "diffusion3d.commands.common" in imported_modules(source, "diffusion3d.evaluation.x")
    assert fake not in COMMAND_FILES


@pytest.mark.slow
def test_library_modules_never_import_a_command():
    """Dynamic: every library module, imported in a fresh process, pulls in no command module."""
    library = library_modules()
    assert {
        "diffusion3d.trainer",
        "diffusion3d.sampling",
        "diffusion3d.evaluation.scores",
        "diffusion3d.synthetic",
    } <= set(library)
    code = (
        "import sys; " + "; ".join(f"import {m}" for m in library) + "; "
        "bad = [m for m in sys.modules if m.startswith('diffusion3d.commands') or m == 'diffusion3d.__main__']; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_command_runs_from_the_package_entry():
    """``python -m diffusion3d <command>`` knows each command module, and each has a main()."""
    import importlib

    from diffusion3d.commands import COMMANDS

    for name, module in COMMANDS.items():
        assert callable(importlib.import_module(f"diffusion3d.commands.{module}").main), name
