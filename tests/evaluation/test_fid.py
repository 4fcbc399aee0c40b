"""FID / MMD on MedicalNet-layout features: exact formula, a set against itself and a shifted set, weights
files in MedicalNet's and plain layouts, nothing downloaded, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffusion3d.commands import evaluate as E
from diffusion3d.evaluation import fid as D
from tests.helpers import phantom, write_nifti

SIZE = 16


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A randomly initialised ResNet-50 of the MedicalNet layout, saved as MedicalNet does (DataParallel's
    "module." prefix under "state_dict", with its segmentation head) and as a plain state dict."""
    torch.manual_seed(0)
    state = D.build_feature_network("resnet50").state_dict()
    folder = tmp_path_factory.mktemp("weights")
    medicalnet = {f"module.{k}": v for k, v in state.items()} | {"module.conv_seg.0.weight": torch.zeros(2, 2)}
    torch.save({"state_dict": medicalnet, "epoch": 0}, folder / "medicalnet.pth")
    torch.save(state, folder / "plain.pt")
    return folder


@pytest.fixture
def sets(tmp_path):
    """real/: six 16³ phantoms in [0, 1]; same/: the same volumes; contrast/: each one squared (a gamma change:
    darker, with more contrast between its labels — MedicalNet's z-scoring would undo a plain shift or scale)."""
    for i in range(6):
        image = np.clip(phantom(SIZE, i)[0], 0, 1)
        write_nifti(tmp_path / "real" / f"case_{i}.nii.gz", image)
        write_nifti(tmp_path / "same" / f"case_{i}_sample0.nii.gz", image)
        write_nifti(tmp_path / "contrast" / f"case_{i}_sample0.nii.gz", image**2)
        write_nifti(tmp_path / "shifted" / f"case_{i}_sample0.nii.gz", np.clip(image + 0.2, 0, 1))
    return tmp_path


def gaussian_fid(a: torch.Tensor, b: torch.Tensor) -> float:
    """MONAI's FIDMetric formula, tr sqrt(Σa Σb) from the eigenvalues of the product (scipy-free)."""
    a, b = a.double(), b.double()
    ca, cb = torch.cov(a.T), torch.cov(b.T)
    eig = torch.linalg.eigvals(ca @ cb).real.clamp(min=0)
    return float(((a.mean(0) - b.mean(0)) ** 2).sum() + ca.trace() + cb.trace() - 2 * eig.sqrt().sum())


@pytest.mark.parametrize("n, m, dim", [(40, 30, 5), (6, 9, 20)])  # full-rank covariances, then singular ones
def test_frechet_distance_is_monai_s_formula(n, m, dim):
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, dim, generator=g, dtype=torch.float64)
    b = (
        1.5
        * torch.randn(m, dim, generator=g, dtype=torch.float64)
        @ torch.randn(dim, dim, generator=g, dtype=torch.float64)
        + 0.5
    )
    assert D.frechet_distance(a, b) == pytest.approx(gaussian_fid(a, b), rel=1e-6)
    assert D.frechet_distance(a, b) == pytest.approx(D.frechet_distance(b, a), rel=1e-9)
    assert abs(D.frechet_distance(a, a)) < 1e-9
    with pytest.raises(ValueError):
        D.frechet_distance(a[:1], b)


def test_mmd_is_monai_s_unbiased_linear_estimate_for_any_set_sizes():
    from monai.metrics import MMDMetric

    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(50, 8, generator=g, dtype=torch.float64),
        torch.randn(60, 8, generator=g, dtype=torch.float64) + 1.0,
    )
    assert D.mmd(a, b[:50]) == pytest.approx(float(MMDMetric()(a, b[:50])), rel=1e-9)  # MONAI's needs n = m
    # Unbiased MMD² with the linear kernel: off-diagonal means within each set, full mean across.
    within = lambda x: float((x @ x.T).sum() - (x * x).sum()) / (len(x) * (len(x) - 1))  # noqa: E731
    assert D.mmd(a, b) == pytest.approx(within(a) + within(b) - 2 * float(a.mean(0) @ b.mean(0)), rel=1e-9)
    assert D.mmd(a, b) == pytest.approx(8.0, rel=0.3)  # |mean difference|² = 8 · 1²


def call(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        E.main(args)
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def argv(root, samples: str, weights, *extra) -> list[str]:
    return [
        "distribution",
        "--real",
        str(root / "real"),
        "--samples",
        str(root / samples),
        "--feature_weights",
        str(weights),
        "--out",
        str(root / f"out_{samples}"),
        "--device",
        "cpu",
        "--real_range",
        "0",
        "1",
        *extra,
    ]


@pytest.mark.parametrize("feature_input", ["zscore", "unit"])
def test_a_set_against_itself_scores_zero_and_a_changed_set_far_more(sets, weights, capsys, feature_input):
    results = {}
    for samples in ("same", "contrast"):
        code, out, err = call(argv(sets, samples, weights / "medicalnet.pth", "--feature_input", feature_input), capsys)
        assert code == 0, err
        results[samples] = json.loads((sets / f"out_{samples}" / "distribution.json").read_text())
        assert "FID" in out and "note: fewer volumes than feature dimensions" in out
    same, changed = results["same"], results["contrast"]
    assert same["n_real"] == same["n_synthetic"] == 6 and same["feature_dim"] == 2048
    assert changed["fid"] > 0.5 and abs(same["fid"]) < 1e-9 * changed["fid"]  # randomly initialised features
    # A set against itself is not two independent draws: its unbiased MMD is -2 tr(cov) / n, below zero.
    assert changed["mmd"] > 2 * abs(same["mmd"]) and same["mmd"] < 0
    ref = changed["reference"]
    assert ref["n"] == 3 and ref["fid_real_vs_synthetic"] > ref["fid_real_vs_real"]


@pytest.mark.parametrize("name", ["resnet10", "resnet18"])  # shortcut B (as ResNet-50) and shortcut A
def test_medicalnet_layout_dilates_layer3_and_layer4_instead_of_striding(name):
    shapes = {}
    for layout in ("medicalnet", "monai"):
        net = D.build_feature_network(name, layout)
        net.layer4.register_forward_hook(lambda m, i, o, layout=layout: shapes.__setitem__(layout, tuple(o.shape[2:])))
        with torch.inference_mode():
            assert net(torch.rand(1, 1, 32, 32, 32)).shape == (1, 512)
    assert shapes == {"medicalnet": (4, 4, 4), "monai": (1, 1, 1)}  # 32 → conv1 16 → pool 8 → layer2 4
    medicalnet = D.build_feature_network(name)
    assert medicalnet.layer4[0].conv2.dilation == (4, 4, 4) and medicalnet.layer3[0].conv2.padding == (2, 2, 2)
    assert medicalnet.state_dict().keys() == D.build_feature_network(name, "monai").state_dict().keys()


def test_plain_state_dict_gives_the_same_features(weights):
    volumes = [np.random.default_rng(i).random((SIZE,) * 3).astype(np.float32) for i in range(3)]
    a = D.features(D.load_feature_network(weights / "medicalnet.pth"), volumes)
    b = D.features(D.load_feature_network(weights / "plain.pt"), volumes)
    assert a.shape == (3, 2048) and torch.equal(a, b) and a.std() > 0
    assert D.mmd(a, a) == pytest.approx(-2 * float(torch.cov(a.T).trace()) / 3, rel=1e-9)


def test_nothing_is_downloaded(sets, weights, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a download was attempted")

    import monai.networks.nets.resnet as resnet

    monkeypatch.setattr(resnet, "get_pretrained_resnet_medicalnet", refuse)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    code, _, err = call(argv(sets, "same", weights / "plain.pt"), capsys)
    assert code == 0, err


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_weights", "--feature_weights PATH is required"),
        ("missing_file", "file not found"),
        ("garbage", "not a PyTorch weights file"),
        ("wrong_layout", "not the MedicalNet resnet50 layout"),
        ("one_volume", "need at least 2 volumes"),
        ("exists", "already exists"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(sets, weights, capsys, tmp_path, case, message):
    args = argv(sets, "same", weights / "plain.pt")
    out = sets / "out_same"
    if case == "no_weights":
        i = args.index("--feature_weights")
        del args[i : i + 2]
    elif case == "missing_file":
        args[args.index("--feature_weights") + 1] = str(tmp_path / "nowhere.pth")
    elif case == "garbage":
        (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
        args[args.index("--feature_weights") + 1] = str(tmp_path / "garbage.pth")
    elif case == "wrong_layout":
        torch.save(torch.nn.Conv3d(1, 4, 3).state_dict(), tmp_path / "small.pt")
        args[args.index("--feature_weights") + 1] = str(tmp_path / "small.pt")
    elif case == "one_volume":
        for p in sorted((sets / "same").iterdir())[1:]:
            p.unlink()
    elif case == "exists":
        out.mkdir()
        (out / "distribution.json").write_text("keep")
    code, _, err = call(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    if case == "exists":
        assert (out / "distribution.json").read_text() == "keep"
    else:
        assert not out.exists()


def test_a_shifted_set_scores_higher_than_the_set_itself_on_unit_input(sets, weights, capsys):
    """The issue's check as stated: a set shifted by +0.2 in intensity is farther than the set itself (with
    --feature_input unit, where no per-volume z-score can undo the shift)."""
    fid = {}
    for samples in ("same", "shifted"):
        code, _, err = call(argv(sets, samples, weights / "medicalnet.pth", "--feature_input", "unit"), capsys)
        assert code == 0, err
        fid[samples] = json.loads((sets / f"out_{samples}" / "distribution.json").read_text())["fid"]
    assert abs(fid["same"]) < 1e-9 and fid["shifted"] > 0.1  # measured 0.96 on these phantoms
