"""The sampling library: one entry point, per-volume seeds, masks read once, defaults in one place, loading."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from diffusion3d import checkpoint as ckpt
from diffusion3d import config as C
from diffusion3d import sampling
from diffusion3d import space as S
from diffusion3d.data import discover
from diffusion3d.diffusion import SAMPLERS, GaussianDiffusion, RectifiedFlow
from diffusion3d.model import build_model
from diffusion3d.trainer import build_trainer
from tests.helpers import tiny_config, write_nifti


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """An untrained tiny model and its config (the loops and seeds do not care about training)."""
    cfg = tiny_config(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    return build_model(cfg).eval(), cfg


def random_mask(cfg, seed: int) -> sampling.ModelGridMask:
    g = torch.Generator().manual_seed(seed)
    return sampling.ModelGridMask(torch.randint(0, 3, (1, *cfg.data.image_size), generator=g, dtype=torch.uint8))


def test_batch_of_one_equals_diffusion_sample_and_keeps_its_noise_in_a_batch(untrained):
    """Volume b of a batch draws its noise as diffusion.sample(seed=seeds[b]) does for a batch of one, for
    every sampler (the loops must not drift apart); in a batch of two a volume keeps its noise."""
    model, cfg = untrained
    diffusion = GaussianDiffusion.from_config(cfg)
    grids = [random_mask(cfg, 0), random_mask(cfg, 1)]
    cond = grids[0].cond(cfg.data.labels)[None]
    shape = (1, cfg.image_channels, *cfg.data.image_size)
    single = {}
    for sampler in diffusion.samplers:
        ref = diffusion.sample(model, shape, cond, sampler=sampler, steps=2, eta=cfg.diffusion.ddim_eta, seed=11)
        (out,) = sampling.generate(model, cfg, grids[:1], [11], sampler=sampler, steps=2, batch_size=1)
        torch.testing.assert_close(out.model_grid, ref.clamp(-1, 1)[0], rtol=0, atol=0, msg=f"{sampler}: differs")
        single[sampler] = out.model_grid
    pair = list(sampling.generate(model, cfg, grids, [11, 12], sampler="ddpm", steps=2, batch_size=2))
    assert [s.index for s in pair] == [0, 1]
    torch.testing.assert_close(pair[0].model_grid, single["ddpm"], rtol=0, atol=1e-4)  # batched convs round differently
    assert (pair[1].model_grid - pair[0].model_grid).abs().max() > 0.1


@pytest.mark.parametrize("levels", [1, 2])
def test_wavelet_model_samples_subbands_and_generate_decodes_them(tmp_path, levels):
    """In wavelet space generate samples the latent shape with the condition on the subband grid, and
    returns the decoded volume on the model grid: decode(diffusion.sample(...)) clamped, nothing else."""
    cfg = tiny_config(tmp_path, space="wavelet", wavelet_levels=levels, prediction="flow", sampler="euler", loss="l2")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    assert model.image_channels == 8**levels and model.cond_channels == 2 * 8**levels
    grid = random_mask(cfg, 0)
    space = S.make_space(cfg)
    cond = space.cond(grid.cond(cfg.data.labels)[None])
    assert cond.shape == (1, 2 * 8**levels, *[16 // 2**levels] * 3)
    latent = RectifiedFlow.from_config(cfg).sample(
        model, (1, *space.latent_shape(1, [16] * 3)), cond, "euler", 2, seeds=[11]
    )
    (out,) = sampling.generate(model, cfg, [grid], [11], sampler="euler", steps=2)
    assert out.model_grid.shape == (1, 16, 16, 16)
    torch.testing.assert_close(out.model_grid, space.decode(latent).clamp(-1, 1)[0], rtol=0, atol=0)


def test_generate_batches_in_order_and_writes_on_each_masks_grid(untrained, tmp_path):
    """Three masks of different shapes in batches of 2: volumes come back in order, each on its mask's grid,
    and a volume does not depend on the batch size (to float rounding)."""
    model, cfg = untrained
    grids = []
    for i, shape in enumerate([(20, 18, 14), (16, 16, 16), (12, 24, 16)]):
        mask = np.zeros(shape, np.uint8)
        mask[3:-3, 3:-3, 3:-3] = 1
        mask[6:-6, 6:-6, 6:-6] = 2
        affine = np.diag([1.2, 0.9, 2.0, 1.0])
        affine[:3, 3] = [i, -i, 5.0]
        grids.append(sampling.load_mask(write_nifti(tmp_path / f"m{i}.nii.gz", mask, affine), cfg))
    seeds = [sampling.volume_seed(0, f"m{i}", 0) for i in range(3)]
    by_two = list(sampling.generate(model, cfg, grids, seeds, steps=2, batch_size=2))
    by_three = list(sampling.generate(model, cfg, grids, seeds, steps=2, batch_size=3))
    assert [s.index for s in by_two] == [0, 1, 2]
    for s, t, grid in zip(by_two, by_three, grids):
        assert s.mask_grid.shape == (1, *grid.original_shape)
        np.testing.assert_allclose(s.mask_grid, t.mask_grid, rtol=0, atol=1e-4)
        path = sampling.write_volume(s, grid, cfg, tmp_path / f"out{s.index}.nii.gz")
        img = nib.load(str(path))
        assert img.shape == grid.original_shape
        np.testing.assert_allclose(img.affine, grid.original_affine, atol=1e-6)
        data = np.asarray(img.dataobj)
        assert 0.0 <= data.min() and data.max() <= 1.0  # output_intensity: unit
    with pytest.raises(ValueError, match="3 grids but 2 seeds"):
        list(sampling.generate(model, cfg, grids, seeds[:2]))


def test_load_mask_reads_the_file_once(untrained, tmp_path, monkeypatch):
    _, cfg = untrained
    mask = np.zeros((16, 16, 16), np.uint8)
    mask[4:12, 4:12, 4:12] = 2
    path = write_nifti(tmp_path / "m.nii.gz", mask)
    opened = []
    real_load = nib.load
    monkeypatch.setattr(nib, "load", lambda p, *a, **k: opened.append(str(p)) or real_load(p, *a, **k))
    grid = sampling.load_mask(path, cfg)
    assert opened == [str(path)]
    assert grid.mask.shape == (1, 16, 16, 16) and int(grid.mask.max()) == 2
    grid.invert(torch.zeros(1, 16, 16, 16))
    assert opened == [str(path)]  # the inverse needs no file


def test_steps_and_sampler_are_resolved_in_one_place(tmp_path):
    cfg = tiny_config(tmp_path, timesteps=50, sampling_steps=7)
    assert sampling.resolve(cfg) == sampling.Recipe("ddim", 7, 1.0, cfg.diffusion.ddim_eta, 7)
    assert sampling.resolve(cfg, "ddpm").steps == 50  # ddpm: every training timestep by default
    assert sampling.resolve(cfg, "ddpm", steps=3).steps == 3
    assert sampling.resolve(cfg, "dpmpp2m", guidance=2.0).guidance == 2.0
    with pytest.raises(sampling.SamplingError, match="euler does not fit this checkpoint's eps model") as e:
        sampling.resolve(cfg, "euler")
    assert e.value.key == "sampler"
    # without a config the objective's table decides (the benchmark's defaults)
    gauss, flow = (
        GaussianDiffusion.from_config(cfg),
        RectifiedFlow.from_config(tiny_config(tmp_path / "f", prediction="flow", sampler="euler")),
    )
    defaults = {name: spec.default_steps for name, spec in SAMPLERS.items()}
    assert [gauss.default_steps(s) for s in ("ddim", "ddpm", "dpmpp2m")] == [defaults["ddim"], 50, defaults["dpmpp2m"]]
    assert flow.default_steps("heun") == defaults["heun"] and flow.default_steps("heun", 5) == 5
    assert gauss.evaluations("dpmpp2m", None) == defaults["dpmpp2m"]
    with pytest.raises(ValueError, match="unknown sampler"):
        gauss.default_steps("euler")


def test_guidance_needs_a_conditional_model(tmp_path):
    cfg = tiny_config(tmp_path, with_condition=False)
    assert sampling.resolve(cfg).guidance == 1.0
    with pytest.raises(sampling.SamplingError, match="unconditional") as e:
        sampling.resolve(cfg, guidance=1.5)
    assert e.value.key == "guidance_scale"


@pytest.mark.parametrize(
    "precision, expected", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float32)]
)
def test_generate_runs_the_runs_precision_resolved_for_the_device(untrained, monkeypatch, precision, expected):
    """bf16 autocasts on the CPU (as training did); fp16 does not exist there, so it samples in fp32."""
    monkeypatch.setattr("diffusion3d.precision.cpu_has_fast_bf16", lambda: True)  # a CPU with AVX-512 or AMX
    model, cfg = untrained
    cfg = C.from_dict(cfg.to_dict())
    cfg.train.precision = precision
    seen = []
    handle = model.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    try:
        list(sampling.generate(model, cfg, [random_mask(cfg, 0)], [0], steps=1))
    finally:
        handle.remove()
    assert seen == [expected]


def test_load_for_sampling_takes_the_ema_or_the_raw_weights(tmp_path):
    cfg = tiny_config(tmp_path, ema_decay=0.5, ema_warmup=False)
    trainer = build_trainer(cfg, discover(cfg), "cpu", None)
    for _ in range(3):
        trainer.train_step()
    path = tmp_path / "step_00000003.pt"
    ckpt.save_atomic(trainer.state_dict(), path)
    for weights, source in [("ema", trainer.ema.module), ("model", trainer.model)]:
        model, loaded_cfg, state = sampling.load_for_sampling(path, weights=weights)
        assert not model.training and state["path"] == str(path) and loaded_cfg.to_dict() == cfg.to_dict()
        for a, b in zip(model.state_dict().values(), source.state_dict().values()):
            assert torch.equal(a, b), weights
    with pytest.raises(ValueError, match="weights"):
        sampling.load_for_sampling(path, weights="best")
    state = trainer.state_dict()
    state["config"]["model"]["channels"] = [4, 8]  # weights no longer fit
    with pytest.raises(ckpt.CheckpointError, match="do not fit the model of its config"):
        sampling.load_for_sampling(path, state)


def test_volume_seed_depends_on_seed_case_and_index_only():
    seeds = {sampling.volume_seed(s, c, i) for s in (0, 1) for c in ("a", "b") for i in (0, 1)}
    assert len(seeds) == 8
    assert sampling.volume_seed(3, "case", 2) == sampling.volume_seed(3, "case", 2)


def test_guidance_on_a_model_trained_without_dropout_warns(tmp_path, caplog):
    from diffusion3d import sampling
    from tests.helpers import tiny_config

    cfg = tiny_config(tmp_path, prediction="flow", sampler="heun", loss="l2", cond_drop_prob=0.0)
    with caplog.at_level("WARNING", logger="diffusion3d.sampling"):
        assert sampling.resolve(cfg, guidance=1.0).guidance == 1.0
        assert not caplog.records
        assert sampling.resolve(cfg, guidance=1.5).guidance == 1.5
    assert any("without condition dropout" in r.getMessage() for r in caplog.records)
    caplog.clear()
    cfg.diffusion.cond_drop_prob = 0.1
    with caplog.at_level("WARNING", logger="diffusion3d.sampling"):
        sampling.resolve(cfg, guidance=1.5)
    assert not caplog.records
