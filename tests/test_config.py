"""Config validation of the recipe keys: objective and sampler must fit, guidance needs a condition."""

from __future__ import annotations

import pytest

from conftest import ROOT, configure
from diffusion3d import config as C


@pytest.mark.parametrize("values,message", [
    (dict(prediction="flow", sampler="ddim"), "sampler: 'ddim' does not fit prediction 'flow'"),
    (dict(prediction="eps", sampler="heun"), "sampler: 'heun' does not fit prediction 'eps'"),
    (dict(prediction="flow", sampler="euler", min_snr_gamma=5.0), "min_snr_gamma: applies to Gaussian"),
    (dict(cond_drop_prob=1.0), "cond_drop_prob: must be in [0, 1)"),
    (dict(guidance_scale=-1.0), "guidance_scale: must be at least 0"),
    (dict(guidance_scale=2.0, with_condition=False), "guidance_scale: needs with_condition"),
    (dict(prediction="flow", sampler="euler", flow_shift=0.0), "flow_shift: must be positive"),
])
def test_bad_recipe_combinations_are_refused(values, message):
    with pytest.raises(C.ConfigError) as e:
        configure(C.Config(), **values)
    assert message in str(e.value)


def test_shipped_configs_are_valid():
    for name in ("default", "whole_head_128"):
        C.validate(C.load(ROOT / "diffusion3d" / "configs" / f"{name}.yaml"))
