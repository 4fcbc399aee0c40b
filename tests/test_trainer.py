"""The Trainer: loss contract, accumulation invariance, mixed precision, non-finite steps, EMA, lr schedule."""

from __future__ import annotations

import logging

import pytest
import torch

from diffusion3d.data import discover, mask_to_cond
from diffusion3d.trainer import NonFiniteError, build_trainer, ema_decay_at, lr_at
from tests.helpers import tiny_config


def trainer_for(cfg, results=None):
    return build_trainer(cfg, discover(cfg), "cpu", results)


@pytest.fixture
def precision_as_given(monkeypatch):
    """build_trainer without its precision resolution: these tests run fp16's and bf16's logic on the CPU on
    purpose (fp16 autocast and GradScaler('cpu'), bf16 even where this CPU emulates it)."""
    monkeypatch.setattr("diffusion3d.trainer.resolve_precision", lambda precision, device: precision)


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_accumulated_gradient_equals_one_large_batch(tmp_path):
    """batch 1 × accum 4 accumulates exactly the gradient of the mean loss over the same 4 samples."""
    cfg = tiny_config(tmp_path, batch_size=1, gradient_accumulate_every=4)
    trainer = trainer_for(cfg)
    losses, _ = trainer.accumulate()
    accumulated = [p.grad.clone() for p in trainer.model.parameters()]
    assert trainer.stream.samples_seen == 4

    # direct: one batch of the same four samples (ids 0..3), mean loss, one backward
    trainer.model.zero_grad(set_to_none=True)
    items = [trainer.dataset[trainer.stream.index(k)] for k in range(4)]
    x0 = torch.stack([it["image"] for it in items])
    cond = mask_to_cond(torch.stack([it["mask"] for it in items]), cfg.data.labels)
    direct_losses = trainer.diffusion.loss(trainer.model, x0, cond, [0, 1, 2, 3])
    direct_losses.mean().backward()
    torch.testing.assert_close(losses, direct_losses.detach(), rtol=1e-5, atol=1e-6)
    for a, d in zip(accumulated, (p.grad for p in trainer.model.parameters())):
        torch.testing.assert_close(a, d, rtol=1e-4, atol=1e-7)


def test_logged_loss_is_the_true_mean_not_the_divided_one(tmp_path):
    cfg = tiny_config(tmp_path, batch_size=1, gradient_accumulate_every=3)
    trainer = trainer_for(cfg)
    reference = trainer_for(tiny_config(tmp_path / "ref", batch_size=3, gradient_accumulate_every=1))
    reference.model.load_state_dict(trainer.model.state_dict())
    with torch.no_grad():
        items = [reference.dataset[reference.stream.index(k)] for k in range(3)]
        x0 = torch.stack([it["image"] for it in items])
        cond = mask_to_cond(torch.stack([it["mask"] for it in items]), cfg.data.labels)
        expected = reference.diffusion.loss(reference.model, x0, cond, [0, 1, 2]).mean().item()
    result = trainer.train_step()
    assert result.loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("splits", [[(2, 1), (1, 2)], [(4, 1), (2, 2), (1, 4)]])
def test_accumulation_invariance_end_to_end(tmp_path, splits):
    """3 optimizer steps give the same weights for every split of the same effective batch (fp32, CPU)."""
    results = []
    for i, (bs, accum) in enumerate(splits):
        cfg = tiny_config(tmp_path / str(i), batch_size=bs, gradient_accumulate_every=accum, max_grad_norm=1e9)
        trainer = trainer_for(cfg)
        for _ in range(3):
            trainer.train_step()
        results.append((flat_weights(trainer.model), flat_weights(trainer.ema.module), trainer.stream.samples_seen))
    base_w, base_ema, base_seen = results[0]
    scale = base_w.abs().max()
    for w, ema, seen in results[1:]:
        assert seen == base_seen == 3 * splits[0][0] * splits[0][1]
        assert (w - base_w).abs().max() <= 1e-5 * scale
        assert (ema - base_ema).abs().max() <= 1e-5 * scale


def test_flips_reach_training_and_keep_the_split_invariance(tmp_path):
    """data.flip_axes changes what is trained on, and 2 × 1 and 1 × 2 still take the same steps."""
    runs = {}
    for name, bs, accum, axes in (("plain", 2, 1, []), ("2x1", 2, 1, [0, 1, 2]), ("1x2", 1, 2, [0, 1, 2])):
        cfg = tiny_config(
            tmp_path / name, batch_size=bs, gradient_accumulate_every=accum, max_grad_norm=1e9, flip_axes=axes
        )
        trainer = trainer_for(cfg)
        for _ in range(3):
            trainer.train_step()
        runs[name] = flat_weights(trainer.model)
    scale = runs["2x1"].abs().max()
    assert (runs["2x1"] - runs["1x2"]).abs().max() <= 1e-5 * scale
    assert (runs["2x1"] - runs["plain"]).abs().max() > 1e-3 * scale


def test_affine_augmentation_reaches_training_and_keeps_the_split_invariance(tmp_path):
    """data.affine_*: each sample's rotation, scale and shift change what is trained on, and 2 × 1 and 1 × 2
    still take the same steps (the draw is per sample id, not per micro-batch)."""
    ranges = {"affine_rotate": 10.0, "affine_scale": 0.1, "affine_translate": 0.05}
    runs, losses = {}, {}
    for name, bs, accum, aug in (("plain", 2, 1, {}), ("2x1", 2, 1, ranges), ("1x2", 1, 2, ranges)):
        cfg = tiny_config(tmp_path / name, batch_size=bs, gradient_accumulate_every=accum, max_grad_norm=1e9, **aug)
        trainer = trainer_for(cfg)
        losses[name] = [trainer.train_step().loss for _ in range(3)]
        runs[name] = flat_weights(trainer.model)
    scale = runs["2x1"].abs().max()
    # Adam turns the float rounding of near-zero gradient entries into lr-sized steps: a few 1e-5s, not data's
    assert (runs["2x1"] - runs["1x2"]).abs().max() <= 5e-5 * scale
    assert losses["2x1"] == pytest.approx(losses["1x2"], rel=1e-4)
    assert (runs["2x1"] - runs["plain"]).abs().max() > 1e-3 * scale


@pytest.mark.parametrize("levels, cond", [(1, "haar"), (2, "haar"), (1, "pool"), (1, "labelmap")])
def test_accumulation_invariance_in_wavelet_space(tmp_path, levels, cond):
    """Every split of the effective batch accumulates the same gradient and loss when the diffusion runs on
    Haar subbands (the trainer encodes per micro-batch; encoding is per sample). Compared step by step with
    the weights kept equal: Adam turns float-rounding differences of near-zero gradient entries into
    lr-sized steps (MONAI zero-initialises the output conv, so the second step is most weights' first), which
    would hide the invariance behind optimizer noise in an end-to-end weight comparison."""
    trainers = []
    for i, (bs, accum) in enumerate([(4, 1), (1, 4), (2, 2)]):
        cfg = tiny_config(
            tmp_path / str(i),
            batch_size=bs,
            gradient_accumulate_every=accum,
            max_grad_norm=1e9,
            space="wavelet",
            wavelet_levels=levels,
            wavelet_cond=cond,
        )
        trainer = trainer_for(cfg)
        assert trainer.model.image_channels == 8**levels
        grads: list[torch.Tensor] = []
        step = trainer._optimizer_step
        model = trainer.model
        trainer._optimizer_step = lambda finite, step=step, grads=grads, model=model: (
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()])),
            step(finite),
        )
        trainers.append((trainer, grads))
    reference = trainers[0][0]
    for _ in range(3):
        losses, weights = [], {k: v.clone() for k, v in reference.model.state_dict().items()}
        for trainer, _ in trainers:
            trainer.model.load_state_dict(weights)
            losses.append(trainer.train_step().loss)
        assert max(losses) - min(losses) <= 1e-6 * abs(losses[0])
    base = trainers[0][1]
    assert len(base) == 3 and base[-1].abs().max() > 0
    for _, grads in trainers[1:]:
        for g, g0 in zip(grads, base):
            assert (g - g0).abs().max() <= 1e-5 * g0.abs().max()


def test_the_trainer_feeds_the_diffusion_encoded_images_and_conditions(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, batch_size=2, space="wavelet", wavelet_levels=1)
    trainer = trainer_for(cfg)
    seen = {}

    def loss(model, x0, cond, ids, autocast=None):
        seen.update(x0=x0, cond=cond, ids=ids)
        return torch.zeros(len(ids), requires_grad=True)

    monkeypatch.setattr(trainer.diffusion, "loss", loss)
    trainer.accumulate()
    items = [trainer.dataset[trainer.stream.index(k)] for k in seen["ids"]]
    x0 = torch.stack([it["image"] for it in items])
    cond = mask_to_cond(torch.stack([it["mask"] for it in items]), cfg.data.labels)
    torch.testing.assert_close(seen["x0"], trainer.space.encode(x0))
    torch.testing.assert_close(seen["cond"], trainer.space.encode(cond))  # the default condition: its subbands
    assert seen["x0"].shape == (2, 8, 8, 8, 8) and seen["cond"].shape == (2, 16, 8, 8, 8)


def test_accumulation_loop_never_syncs_with_the_host(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, batch_size=1, gradient_accumulate_every=3)
    trainer = trainer_for(cfg)

    def guard(original):
        def checked(tensor, *args, **kwargs):
            # integer bookkeeping (sample ids, the loader's base seed) lives on the host anyway
            if tensor.dtype.is_floating_point:
                raise AssertionError("host-device sync on a float tensor inside the accumulation loop")
            return original(tensor, *args, **kwargs)

        return checked

    monkeypatch.setattr(torch.Tensor, "item", guard(torch.Tensor.item))
    monkeypatch.setattr(torch.Tensor, "tolist", guard(torch.Tensor.tolist))
    trainer.accumulate()


def poison_next_forward(trainer):
    """Make the next forward pass produce NaN (then remove itself)."""

    def hook(module, args, output):
        handle.remove()
        return output * float("nan")

    handle = trainer.model.register_forward_hook(hook)


def test_fp32_nonfinite_step_is_skipped_and_counted(tmp_path, caplog):
    cfg = tiny_config(tmp_path, batch_size=1, gradient_accumulate_every=2)
    trainer = trainer_for(cfg)
    trainer.train_step()
    before, ema_before = flat_weights(trainer.model), flat_weights(trainer.ema.module)
    poison_next_forward(trainer)
    with caplog.at_level(logging.WARNING):
        result = trainer.train_step()
    assert result.skipped and trainer.skipped_steps == 1
    assert "non-finite" in caplog.text
    assert torch.equal(flat_weights(trainer.model), before)
    assert torch.equal(flat_weights(trainer.ema.module), ema_before)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert not trainer.train_step().skipped  # the next good step trains again
    assert trainer.nonfinite_run == 0


def test_consecutive_nonfinite_steps_stop_training(tmp_path):
    cfg = tiny_config(tmp_path, max_nonfinite_steps=3)
    trainer = trainer_for(cfg)
    trainer.model.register_forward_hook(lambda m, a, out: out * float("nan"))
    trainer.train_step()
    trainer.train_step()
    with pytest.raises(NonFiniteError, match="3 consecutive steps"):
        trainer.train_step()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fp16_logic_on_cpu_scaler_skips_and_leaves_ema_alone(tmp_path, precision_as_given, optimizer):
    """fp16 autocast + GradScaler('cpu'): one unscale/step/update per step; an inf step is skipped, with
    either optimizer (the scaler unscales and skips Muon's groups like AdamW's)."""
    cfg = tiny_config(tmp_path, precision="fp16", batch_size=1, gradient_accumulate_every=2, optimizer=optimizer)
    trainer = trainer_for(cfg)
    assert trainer.scaler.is_enabled() and trainer.precision == "fp16"
    first = trainer.train_step()
    assert not first.skipped
    scale = trainer.scaler.get_scale()
    weights, ema = flat_weights(trainer.model), flat_weights(trainer.ema.module)
    poison_next_forward(trainer)
    result = trainer.train_step()
    assert result.skipped and trainer.skipped_steps == 1
    assert trainer.scaler.get_scale() == scale / 2  # the scaler backed off once
    assert torch.equal(flat_weights(trainer.model), weights)
    assert torch.equal(flat_weights(trainer.ema.module), ema)
    assert trainer.model.unet.conv_in.conv.weight.dtype == torch.float32  # master weights stay fp32


def test_fp16_noising_and_loss_stay_fp32(tmp_path, precision_as_given):
    cfg = tiny_config(tmp_path, precision="fp16")
    trainer = trainer_for(cfg)
    seen = {}
    trainer.model.register_forward_hook(lambda m, args, out: seen.update(input=args[0].dtype, output=out.dtype))
    losses, _ = trainer.accumulate()
    assert seen == {"input": torch.float32, "output": torch.float16}  # x_t fp32 in, autocast inside
    assert losses.dtype == torch.float32


def test_bf16_runs_without_a_scaler(tmp_path, precision_as_given):
    trainer = trainer_for(tiny_config(tmp_path, precision="bf16"))
    assert trainer.precision == "bf16" and not trainer.scaler.is_enabled()
    result = trainer.train_step()
    assert not result.skipped and result.loss > 0


def test_lr_warmup_and_cosine_count_optimizer_steps(tmp_path):
    assert lr_at(0, 1.0, 4, 100, "constant", 0.1) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 4, 100, "constant", 0.1) == pytest.approx(1.0)
    assert lr_at(50, 1.0, 4, 100, "constant", 0.1) == 1.0
    assert lr_at(4, 1.0, 4, 100, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_at(100, 1.0, 4, 100, "cosine", 0.1) == pytest.approx(0.1)
    lrs = {}
    for accum in (1, 3):
        cfg = tiny_config(
            tmp_path / str(accum),
            batch_size=1,
            gradient_accumulate_every=accum,
            warmup_steps=2,
            lr_schedule="cosine",
            train_num_steps=4,
        )
        trainer = trainer_for(cfg)
        lrs[accum] = [trainer.train_step().lr for _ in range(3)]
    assert lrs[1] == lrs[3]
    assert lrs[1][0] == pytest.approx(cfg.train.lr / 2)


def test_ema_is_a_copy_until_the_start_step(tmp_path):
    cfg = tiny_config(tmp_path, ema_decay=0.9, ema_start_step=2)
    trainer = trainer_for(cfg)
    for _ in range(2):
        trainer.train_step()
        assert torch.equal(flat_weights(trainer.ema.module), flat_weights(trainer.model))
    model2 = flat_weights(trainer.model)
    trainer.train_step()  # step 3: the first average starts from a copy of the model at step 3
    trainer.train_step()  # step 4: 0.9 * ema(3) + 0.1 * model(4)
    assert not torch.equal(flat_weights(trainer.ema.module), flat_weights(trainer.model))
    assert not torch.equal(flat_weights(trainer.ema.module), model2)


def test_ema_update_math(tmp_path):
    cfg = tiny_config(tmp_path, ema_decay=0.9, ema_warmup=False)
    trainer = trainer_for(cfg)
    trainer.train_step()
    assert torch.equal(flat_weights(trainer.ema.module), flat_weights(trainer.model))  # first update copies
    ema1 = flat_weights(trainer.ema.module)
    trainer.train_step()
    torch.testing.assert_close(flat_weights(trainer.ema.module), 0.9 * ema1 + 0.1 * flat_weights(trainer.model))


def test_ema_warmup_ramps_the_decay(tmp_path):
    """With ema_warmup update n uses min(decay, (1 + n) / (10 + n)): 2/11 after the copy, then 3/12, ..."""
    assert ema_decay_at(0, 0.995, True) == 0.0 and ema_decay_at(0, 0.995, False) == 0.0
    assert ema_decay_at(1, 0.995, True) == pytest.approx(2 / 11)
    assert ema_decay_at(10_000, 0.995, True) == 0.995
    assert ema_decay_at(5, 0.995, False) == 0.995
    cfg = tiny_config(tmp_path, ema_decay=0.99, ema_warmup=True, train_num_steps=3)
    trainer = trainer_for(cfg)
    trainer.train_step()
    assert torch.equal(flat_weights(trainer.ema.module), flat_weights(trainer.model))
    for n in (1, 2):
        ema = flat_weights(trainer.ema.module)
        trainer.train_step()
        d = (1 + n) / (10 + n)
        torch.testing.assert_close(flat_weights(trainer.ema.module), d * ema + (1 - d) * flat_weights(trainer.model))
