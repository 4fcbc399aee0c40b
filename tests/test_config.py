"""The config layer: sections, YAML, typed values and choices, --help, the checks of each section and the
cross-section ones (objective and sampler must fit, guidance needs a condition), effective_batch; each key's
metadata as the one source of the resume-breaking keys, the cache key and the docs' key table;
``Config.override``."""

from __future__ import annotations

import dataclasses
import typing

import monai
import pytest

from diffusion3d import checkpoint, configs
from diffusion3d import config as C
from diffusion3d.commands import train as cli
from diffusion3d.data import transform_key
from tests.helpers import ROOT, configure


@pytest.mark.parametrize(
    "values,message",
    [
        (dict(prediction="flow", sampler="ddim"), "sampler: 'ddim' does not fit prediction 'flow'"),
        (dict(prediction="eps", sampler="heun"), "sampler: 'heun' does not fit prediction 'eps'"),
        (dict(prediction="flow", sampler="euler", min_snr_gamma=5.0), "min_snr_gamma: applies to Gaussian"),
        (dict(cond_drop_prob=1.0), "cond_drop_prob: must be in [0, 1)"),
        (dict(guidance_scale=-1.0), "guidance_scale: must be at least 0"),
        (dict(guidance_scale=2.0, with_condition=False), "guidance_scale: needs with_condition"),
        (dict(prediction="flow", sampler="euler", flow_shift=0.0), "flow_shift: must be positive"),
        (dict(prediction="flow", sampler="euler", sampling_shift=-1.0), "sampling_shift: must be positive"),
        (dict(sampling_shift=1.0), "sampling_shift: applies to prediction: flow, not eps"),
        (dict(prediction="flow", sampler="euler", flow_x0_min_t=0.0), "flow_x0_min_t: must be in (0, 1]"),
    ],
)
def test_bad_recipe_combinations_are_refused(values, message):
    with pytest.raises(C.ConfigError) as e:
        configure(C.Config(), **values)
    assert message in str(e.value)


def test_shipped_configs_are_valid():
    for name in ("default", "whole_head_128", "brats_192"):
        C.validate(C.load(ROOT / "diffusion3d" / "configs" / f"{name}.yaml"))


# ---- reading configs: sections, YAML, typed values -------------------------------------------------
def test_unknown_section_and_key_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 0.1\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(path)
    assert str(e.value) == f"{path}: unknown section 'optim' (expected one of data, model, diffusion, train, wavelet)"
    path.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(C.ConfigError, match=r"unknown key 'learning_rate' in section 'train'"):
        C.load(path)
    with pytest.raises(C.ConfigError, match="^unknown config key 'learning_rate'$"):
        C.set_key(C.Config(), "learning_rate", 0.1)


def test_yaml_syntax_error_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: [0.1\n  seed: 3\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: not valid YAML (") and "\n" not in message
    with pytest.raises(C.ConfigError, match="config file not found"):
        C.load(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "key, text, expected",
    [
        ("train_num_steps", "7", 7),
        ("lr", "1e-5", 1e-5),  # YAML 1.1 reads this as a string; a float field takes it
        ("lr", "2", 2.0),  # ints widen to floats
        ("labels", "[1,2,4]", [1, 2, 4]),
        ("spacing", "[1, 1.5, 2]", [1.0, 1.5, 2.0]),
        ("spacing", "null", None),
        ("max_volume_gb", "null", None),
        ("with_condition", "false", False),
        ("image_dir", "[a, b]", ["a", "b"]),
        ("image_dir", "images", "images"),
        ("batch_size", "auto", "auto"),
        ("batch_size", "3", 3),
        ("accum", "4", 4),  # alias of gradient_accumulate_every
    ],
)
def test_typed_values_are_coerced(key, text, expected):
    cfg = C.Config()
    C.set_key(cfg, key, C.parse_value(text))
    section, _ = C.key_index()[C.ALIASES.get(key, key)]
    value = getattr(getattr(cfg, section), C.ALIASES.get(key, key))
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "key, text, message",
    [
        ("train_num_steps", "two", "train_num_steps: expected an integer, got 'two'"),
        ("train_num_steps", "2.5", "train_num_steps: expected an integer, got 2.5"),
        ("lr", "fast", "lr: expected a number, got 'fast'"),
        ("lr", "true", "lr: expected a number, got True"),
        ("with_condition", "1", "with_condition: expected true or false, got 1"),
        ("labels", "3", "labels: expected a list, got 3"),
        ("labels", "[1,x]", "labels: expected an integer, got 'x'"),
        ("labels", "null", "labels: expected a list, got None"),
        ("spacing", "[1,x,2]", "spacing: expected a number, got 'x'"),
        ("spacing", "wide", "spacing: expected a list or null, got 'wide'"),
        ("batch_size", "big", "batch_size: expected a positive integer or auto, got 'big'"),
        ("name", "[a]", "name: expected a string, got ['a']"),
    ],
)
def test_badly_typed_values_are_refused_in_one_line(key, text, message):
    with pytest.raises(C.ConfigError) as e:
        C.set_key(C.Config(), key, C.parse_value(text))
    assert str(e.value) == message


def _literal_keys() -> list[tuple[str, tuple[str, ...]]]:
    keys = []
    for name in C.key_index():
        hint = C.hint_of(name)
        if typing.get_origin(hint) is typing.Literal and len(typing.get_args(hint)) > 1:
            keys.append((name, typing.get_args(hint)))
    return keys


def test_every_choice_key_is_typed():
    """The keys with a fixed set of values carry it in their type (no separate CHOICES table)."""
    assert {name for name, _ in _literal_keys()} == {
        "unknown_labels",
        "intensity",
        "output_intensity",
        "resize_mode",
        "cache",
        "schedule",
        "prediction",
        "loss",
        "sampler",
        "flow_time_sampling",
        "flow_output",
        "lr_schedule",
        "optimizer",
        "precision",
        "space",
        "wavelet_cond",
    }


@pytest.mark.parametrize("key, choices", _literal_keys())
def test_choices_are_refused_naming_the_key_and_the_allowed_values(key, choices):
    with pytest.raises(C.ConfigError) as e:
        C.set_key(C.Config(), key, "nope")
    assert str(e.value) == f"{key}: 'nope' is not one of {', '.join(choices)}"
    # a section built directly (not through set_key) checks itself too
    section, _ = C.key_index()[key]
    with pytest.raises(C.ConfigError, match=f"^{key}: 'nope' is not one of"):
        C.SECTIONS[section](**{key: "nope"}).validate()


def test_choice_on_the_command_line_exits_2_with_one_error_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.run(["--sampler", "lms"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: sampler: 'lms' is not one of ddim, ddpm, dpmpp2m, euler, heun, euler_a (see train.py --help)"
    ]


def test_sections_check_their_own_bounds():
    with pytest.raises(C.ConfigError, match="^keep_last: must be at least 1, got 0$"):
        C.TrainConfig(keep_last=0).validate()
    with pytest.raises(C.ConfigError, match="^labels: must be distinct and non-zero"):
        C.DataConfig(labels=[1, 1]).validate()
    with pytest.raises(C.ConfigError, match="^attention_levels: needs one entry per entry of channels$"):
        C.ModelConfig(channels=[8, 16], attention_levels=[True]).validate()
    section = C.DataConfig(lower_percentile=1)  # an int given where a float is meant: widened in place
    section.validate()
    assert type(section.lower_percentile) is float


# ---- the wavelet section: what a recipe changes where it trains in wavelet space -----------------------
WAVELET_RECIPE = {  # configs/default.yaml's wavelet section (docs/performance.md, "The wavelet space's recipe")
    "wavelet_cond": "labelmap",
    "flow_output": "x0",
    "flow_x0_min_t": 0.3,
    "flow_shift": 3.0,
    "optimizer": "muon",
    "muon_lr_ratio": 3.0,
    "sampling_steps": 10,
    "affine_rotate": 5.0,
    "affine_scale": 0.05,
    "affine_translate": 0.03,
    "affine_prob": 0.25,
    "sampling_shift": 0.5,
}


def _values(cfg, keys):
    return {k: getattr(getattr(cfg, C.key_index()[k][0]), k) for k in keys}


def test_the_demo_config_trains_in_wavelet_space_with_its_wavelet_values():
    """`train.py --space wavelet` (and quality's `--set space=wavelet`) on the demo config gives the wavelet
    recipe; in pixel space nothing of it acts. A resolved wavelet config holds the values in its sections (so a
    checkpoint samples and resumes without flags) and no section left to apply."""
    demo = C.load(configs.find("default"))
    assert demo.wavelet == WAVELET_RECIPE
    pixel = demo.override(image_size=[64, 64, 64])
    assert _values(pixel, WAVELET_RECIPE) == {
        "wavelet_cond": "haar",
        "flow_output": "velocity",
        "flow_x0_min_t": 0.05,
        "flow_shift": 2.0,
        "optimizer": "adamw",
        "muon_lr_ratio": 1.0,
        "sampling_steps": 25,
        "affine_rotate": 0.0,
        "affine_scale": 0.0,
        "affine_translate": 0.0,
        "affine_prob": 1.0,
        "sampling_shift": None,
    }
    assert pixel.wavelet == WAVELET_RECIPE  # kept: a later --space wavelet still gets it
    wavelet = demo.override(space="wavelet", image_size=[64, 64, 64])
    assert _values(wavelet, WAVELET_RECIPE) == WAVELET_RECIPE and wavelet.wavelet == {}
    _, cfg = cli.parse(["--with_condition", "--accum", "2", "--space", "wavelet", "--image_size", "[64,64,64]"])
    assert _values(cfg, WAVELET_RECIPE) == WAVELET_RECIPE and cfg.to_dict() == wavelet.to_dict()
    assert C.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()  # as a checkpoint's config reads back
    assert demo.wavelet == WAVELET_RECIPE  # override copies: the loaded config is untouched


def test_a_key_the_user_names_outranks_the_wavelet_section():
    demo = C.load(configs.find("default"))
    _, cfg = cli.parse(["--space", "wavelet", "--flow_output", "velocity", "--flow_shift", "2"])
    assert (cfg.diffusion.flow_output, cfg.diffusion.flow_shift, cfg.train.optimizer) == ("velocity", 2.0, "muon")
    named_first = demo.override(flow_shift=5.0).override(space="wavelet")  # named before the space: still wins
    assert named_first.diffusion.flow_shift == 5.0 and named_first.diffusion.flow_output == "x0"
    assert demo.override({"space": "wavelet", "sampling_steps": 25}).diffusion.sampling_steps == 25


def test_a_wavelet_section_acts_only_in_wavelet_space_and_is_checked_on_load(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "data:\n  space: wavelet\ndiffusion:\n  prediction: flow\n  sampler: euler\n"
        "wavelet:\n  flow_output: x0\n  accum: 2\n"
    )
    cfg = C.load(path)
    assert cfg.wavelet == {"flow_output": "x0", "gradient_accumulate_every": 2}  # the alias is resolved
    C.validate(cfg)
    assert (cfg.diffusion.flow_output, cfg.train.gradient_accumulate_every, cfg.wavelet) == ("x0", 2, {})
    _, pixel = cli.parse(["--config", str(path), "--space", "pixel"])
    assert pixel.diffusion.flow_output == "velocity"
    assert pixel.wavelet == {"flow_output": "x0", "gradient_accumulate_every": 2}
    for text, message in [
        ("wavelet:\n  flow_outpt: x0\n", "unknown key 'flow_outpt' in section 'wavelet'"),
        ("wavelet:\n  space: pixel\n", "'space' cannot be set in section 'wavelet' (it is what selects it)"),
        ("wavelet:\n  flow_output: x1\n", "wavelet.flow_output: 'x1' is not one of velocity, x0"),
        ("wavelet:\n  lr: fast\n", "wavelet.lr: expected a number, got 'fast'"),
        ("wavelet: [x0]\n", "section 'wavelet' must be a mapping"),
    ]:
        path.write_text(text)
        with pytest.raises(C.ConfigError) as e:
            C.load(path)  # refused when read, even for a run that trains in pixel space
        assert str(e.value) == f"{path}: {message}"


def test_the_wavelet_section_never_refuses_or_logs_a_resume():
    """A checkpoint's config differs from today's only in the wavelet section (one written before the section
    existed, or after its values changed): no difference, breaking or harmless."""
    demo = C.load(configs.find("default"))
    demo.validate()
    older = demo.to_dict()
    del older["wavelet"]
    assert checkpoint.config_differences(older, demo.to_dict()) == ([], [])
    changed = {**demo.to_dict(), "wavelet": {"flow_output": "velocity"}}
    assert checkpoint.config_differences(changed, demo.to_dict()) == ([], [])


# ---- --help ----------------------------------------------------------------------------------------
def test_help_lists_every_key_with_its_meaning_default_and_choices():
    text = " ".join(cli.build_parser().format_help().split())  # what train.py --help prints; argparse wraps lines
    for name, (_section, f) in C.key_index().items():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        meaning = " ".join(f.metadata["help"].split())
        assert f"--{name} " in text, name
        assert f"{meaning} (default: {C.show(default)}" in text, name
    for name, choices in _literal_keys():
        assert f"--{name} {{{','.join(choices)}}} " in text, name
    assert "--batch_size INT|auto " in text and "--spacing [FLOAT,...]|null " in text
    assert "--no_with_condition" in text and "--accum N short for --gradient_accumulate_every" in text
    assert "(default: eps; the default config sets flow)" in text  # configs/default.yaml's own values too
    assert "(default: velocity; x0 in wavelet space)" in text  # and its wavelet section's
    assert "(default: null; the default config sets 2.0; 3.0 in wavelet space)" in text


# ---- image channels: recorded by discovery, never read from files by the config --------------------
def test_image_channels_come_from_the_config_not_from_files(tmp_path):
    manifest = tmp_path / "m.csv"
    manifest.write_text("case,image_0,image_1,mask\n")
    cfg = C.Config()
    C.set_key(cfg, "manifest", str(manifest))
    assert cfg.image_channels == 1  # not the manifest's two columns: only discovery looks at files
    C.set_key(cfg, "image_dir", ["a", "b", "c"])
    assert cfg.image_channels == 3  # before discovery (and for old checkpoints): one per folder
    C.set_key(cfg, "image_channels", 2)
    assert cfg.image_channels == 2
    # a checkpoint's config from before the key existed still loads
    old = C.Config().to_dict()
    del old["data"]["image_channels"]
    restored = C.from_dict(old)
    restored.validate()
    assert restored.image_channels == 1


# ---- effective_batch: samples per optimizer step over all processes --------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("effective, max_batch", [(4, 1), (12, 4), (8, 64), (6, 5)])
def test_every_planned_split_validates_and_loads(world, effective, max_batch):
    """What --batch_size auto writes into the config on any number of processes is a valid config when
    it is read back (as resume and the sample command do), and matches that number of processes."""
    from diffusion3d.memory import plan_accumulation

    if effective % world:
        return
    cfg = configure(C.Config(), batch_size="auto", effective_batch=effective)
    cfg.train.batch_size, cfg.train.gradient_accumulate_every = plan_accumulation(effective // world, max_batch)
    cfg.train.check_processes(world)
    restored = C.from_dict(cfg.to_dict(), "checkpoint")
    restored.validate()
    assert restored.train.batch_size * restored.train.gradient_accumulate_every * world == effective


def test_fixed_split_must_match_the_number_of_processes():
    cfg = configure(C.Config(), batch_size=2, gradient_accumulate_every=2, effective_batch=8)  # 2 processes
    cfg.train.check_processes(2)
    with pytest.raises(C.ConfigError) as e:
        cfg.train.check_processes(1)
    assert str(e.value).startswith("effective_batch: 8 is not batch_size 2 × accum 2 × 1 process(es) = 4")
    with pytest.raises(C.ConfigError, match="effective_batch: 6 is not batch_size 2 × accum 2 × a number of processes"):
        configure(C.Config(), batch_size=2, gradient_accumulate_every=2, effective_batch=6)


# ---- Config.override: copy, set keys by name, validate ----------------------------------------------
def test_override_is_a_validated_copy():
    base = C.load(configs.DEFAULT)
    before = base.to_dict()
    cfg = base.override({"lr": "1e-5", "accum": 3}, batch_size=4, spacing=None)
    assert (cfg.train.lr, cfg.train.gradient_accumulate_every, cfg.train.batch_size) == (1e-5, 3, 4)
    assert base.to_dict() == before and cfg.model is not base.model  # the original is untouched
    assert base.override([("seed", 1), ("seed", 2)]).train.seed == 2  # pairs in order, the last wins
    with pytest.raises(C.ConfigError, match="^unknown config key 'colour'$"):
        base.override(colour="red")
    with pytest.raises(C.ConfigError, match="^lr: expected a number, got 'fast'$"):
        base.override(lr="fast")
    with pytest.raises(C.ConfigError, match="^sampler: 'ddim' does not fit prediction 'flow'"):
        base.override(sampler="ddim")  # each value is fine alone: the copy is validated as a whole
    assert base.to_dict() == before


# ---- the metadata: breaking keys, cache key ---------------------------------------------------------
def test_resume_breaking_keys_come_from_the_metadata():
    """checkpoint.BREAKING_KEYS is derived from key(..., breaks_resume=True): the same keys as the
    hand-written table it replaced, plus the space keys."""
    assert {s: set(k) for s, k in checkpoint.BREAKING_KEYS.items()} == {
        "model": {
            "with_condition",
            "channels",
            "num_res_blocks",
            "attention_levels",
            "num_head_channels",
            "norm_num_groups",
        },
        "diffusion": {"timesteps", "schedule", "prediction", "flow_output"},
        "data": {
            "image_dir",
            "mask_dir",
            "manifest",
            "image_suffix",
            "mask_suffix",
            "labels",
            "orientation",
            "spacing",
            "intensity",
            "lower_percentile",
            "upper_percentile",
            "intensity_range",
            "image_size",
            "resize_mode",
            "num_val_cases",
            "space",
            "wavelet_levels",
            "wavelet_cond",
        },
        "train": {"seed", "optimizer"},
    }
    # a checkpoint written before a key existed lacks it: it ran with the key's default, and still resumes
    older = C.Config().to_dict()
    del older["data"]["wavelet_cond"]
    assert checkpoint.config_differences(older, C.Config().to_dict()) == ([], [])
    pooled = C.Config().to_dict()
    pooled["data"]["wavelet_cond"] = "pool"
    # in pixel space the wavelet keys act on nothing: a difference there is harmless (the demo config's
    # wavelet_cond changing under a pixel-space run must not refuse its resume)
    assert checkpoint.config_differences(older, pooled) == ([], ["data.wavelet_cond: 'haar' -> 'pool'"])
    older["data"]["space"] = pooled["data"]["space"] = "wavelet"
    assert checkpoint.config_differences(older, pooled)[0] == ["data.wavelet_cond: 'haar' -> 'pool'"]
    wavelet = {**pooled, "data": {**pooled["data"], "wavelet_levels": 2}}
    pixel = {**wavelet, "data": {**wavelet["data"], "space": "pixel"}}
    assert checkpoint.config_differences(pooled, pixel)[0] == [
        "data.space: 'wavelet' -> 'pixel'",
        "data.wavelet_levels: 1 -> 2",
    ]
    saved, current = C.Config().to_dict(), C.Config().to_dict()
    current["model"]["channels"], current["train"]["lr"] = [8, 16], 0.5
    assert checkpoint.config_differences(saved, current) == (
        ["model.channels: [32, 64, 64] -> [8, 16]"],
        ["train.lr: 0.0001 -> 0.5"],
    )


def test_cache_keys_come_from_the_metadata_and_the_hash_is_unchanged(monkeypatch):
    """transform_key hashes the keys with key(..., cache=True), in the layout it had before, so disk caches
    built before keep their folder name (the values were computed with the code before the metadata)."""
    assert C.keys_where("cache") == {
        "data": (
            "orientation",
            "spacing",
            "intensity",
            "lower_percentile",
            "upper_percentile",
            "intensity_range",
            "image_size",
            "resize_mode",
        ),
        "model": ("with_condition",),
    }
    breaking = checkpoint.BREAKING_KEYS
    assert all(set(names) <= set(breaking[s]) for s, names in C.keys_where("cache").items())  # new data: new run
    monkeypatch.setattr(monai, "__version__", "1.6.1")
    assert transform_key(C.Config()) == "577c0923f238"
    assert transform_key(C.load(configs.DEFAULT)) == "c93b6cfda366"
    changed = C.Config().override(with_condition=False, spacing=[1, 1.5, 2], orientation=None)
    assert transform_key(changed) == "837c31bd3663"
    assert transform_key(C.Config().override(lr=0.5, labels=[1], num_workers=2)) == "577c0923f238"
    assert transform_key(C.Config().override(resize_mode="resize")) != "577c0923f238"


# ---- the docs' key table -----------------------------------------------------------------------------
def test_key_table_says_default_demo_value_resume_and_cache():
    rows = {line.split(" | ")[1].strip("`"): line.split(" | ") for line in C.key_table_markdown().splitlines()[2:]}
    assert set(rows) == set(C.key_index())
    assert rows["prediction"][:5] == ["| diffusion", "`prediction`", "`eps`", "`flow`", "`eps`, `v`, `x0`, `flow`"]
    assert rows["loss"][3] == "`l2`" and rows["schedule"][3] == ""  # the demo's value only where it differs
    assert rows["image_size"][5:7] == ["yes", "yes"] and rows["seed"][5:7] == ["yes", ""]
    assert rows["lr"][5:7] == ["", ""]
    assert rows["flow_output"][3] == "(wavelet: `x0`)" and rows["flow_shift"][3] == "`2.0` (wavelet: `3.0`)"
    assert rows["batch_size"][4] == "integer ≥ 1 or `auto`"
    assert rows["results_dir"][7] == "where checkpoints, logs and samples go (null: runs/\\<config name>) |"


def test_docs_key_table_is_current():
    path = ROOT / C.KEY_TABLE_DOC
    text = path.read_text()
    assert text == C.with_key_table(text, C.key_table_markdown(), str(path)), (
        f"{C.KEY_TABLE_DOC} is out of date: regenerate it with `python -m diffusion3d.config {C.KEY_TABLE_DOC}`"
    )
    with pytest.raises(C.ConfigError, match="no key table markers"):
        C.with_key_table("# no markers", "| table |")
