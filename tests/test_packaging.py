"""The package installed as a user gets it (not editable, no source tree) trains from another folder.

The project is copied, built and installed with pip into a temporary folder (offline: --no-build-isolation
uses this interpreter's setuptools, --no-deps its torch and MONAI), then run from an unrelated folder with
PYTHONPATH holding that folder only: the bundled default config must be found inside the package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, make_dataset

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, site: Path | None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    if site is not None:
        env["PYTHONPATH"] = str(site)  # only the installed copy, never the checkout
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A non-editable install of a copy of the project (the copy keeps build files out of the checkout)."""
    pytest.importorskip("setuptools", reason="building offline needs setuptools in this environment")
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "diffusion3d", src / "diffusion3d", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp / "site"
    proc = run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        cwd=tmp,
        site=None,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def test_installed_package_ships_its_configs(site, tmp_path):
    assert (site / "diffusion3d" / "configs" / "default.yaml").is_file()
    assert (site / "diffusion3d" / "configs" / "whole_head_128.yaml").is_file()
    proc = run(
        [
            sys.executable,
            "-c",
            "import diffusion3d, diffusion3d.commands.train as c; from diffusion3d import configs; "
            "print(diffusion3d.__file__); print(c.DEFAULT_CONFIG); print(configs.find('whole_head_128'))",
        ],
        cwd=tmp_path,
        site=site,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    package, default, named = proc.stdout.split()
    for path in (package, default, named):
        assert Path(path).is_relative_to(site), path  # the installed copy, not the checkout
    assert Path(default).name == "default.yaml" and Path(named).name == "whole_head_128.yaml"


def test_installed_package_trains_from_another_folder(site, tmp_path):
    images, masks = make_dataset(tmp_path / "data", n=4, size=16)
    elsewhere = tmp_path / "elsewhere"  # neither the checkout nor the install: the default config is found by name
    elsewhere.mkdir()
    results = tmp_path / "run"
    flags = [
        "--train_num_steps",
        "2",
        "--image_dir",
        str(images),
        "--mask_dir",
        str(masks),
        "--results_dir",
        str(results),
        "--image_size",
        "[16,16,16]",
        "--device",
        "cpu",
        "--quiet",
    ]
    proc = run([sys.executable, "-m", "diffusion3d", "train", *flags], cwd=elsewhere, site=site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (results / "checkpoints" / "step_00000002.pt").is_file()
    saved = yaml.safe_load((results / "config.yaml").read_text())
    assert saved["name"] == "default" and saved["model"]["channels"] == [16, 32, 64]  # the bundled demo config

    script = site / "bin" / "diffusion3d-train"  # the console script pip wrote for this interpreter
    assert script.is_file()
    proc = run(
        [
            str(script),
            "--check_data",
            "--config",
            "whole_head_128",
            "--image_dir",
            str(images),
            "--mask_dir",
            str(masks),
        ],
        cwd=elsewhere,
        site=site,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cases: 4" in proc.stdout
    assert not list(elsewhere.iterdir())  # --check_data writes nothing
