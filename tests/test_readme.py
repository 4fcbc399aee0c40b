"""The README's first screen stays true: its Python example runs as written (at 2 steps instead of 200)."""

from __future__ import annotations

import re

import nibabel as nib

from tests.helpers import ROOT


def test_the_python_example_trains_and_writes_a_sample_on_the_mask_grid(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 1
    code = blocks[0].replace("train_num_steps = 200", "train_num_steps = 2")
    assert code != blocks[0]
    (tmp_path / "data").symlink_to(ROOT / "data")  # the demo config reads data/demo relative to the cwd
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    sample = nib.load(tmp_path / "case_000_sample0.nii.gz")
    mask = nib.load(ROOT / "data" / "demo" / "masks" / "case_000.nii.gz")
    assert sample.shape == mask.shape and (sample.affine == mask.affine).all()
    assert (tmp_path / "runs" / "api" / "checkpoints" / "step_00000002.pt").is_file()
