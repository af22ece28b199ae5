from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import Root, config_error

from titan_core import ConfigError, allow_nonfinite, load_config, render_help, to_toml
from titan_core.config import ConfigCompat

TOML = """
[job]
dump_folder = "/tmp/run"

[model]
name = "llama3"
converters = ["quantize.linear.float8"]

[training]
steps = 100
seq_len = 8192
max_norm = 1

[parallelism]
tensor_parallel_degree = 8

[quantize.linear.float8]
recipe_name = "rowwise"
filter_fqns = ["output", "router"]
"""


@pytest.fixture
def toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    return path


def test_defaults_without_any_input():
    cfg = load_config(Root, [])
    assert cfg == Root()


def test_toml_values_override_defaults_and_nested_sections_load(toml_file):
    cfg = load_config(Root, ["--job.config_file", str(toml_file)])
    assert cfg.training.steps == 100 and cfg.training.seq_len == 8192
    assert cfg.training.max_norm == 1.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.model.converters == ["quantize.linear.float8"]
    assert cfg.quantize.linear.float8.recipe_name == "rowwise"
    assert cfg.quantize.linear.float8.filter_fqns == ["output", "router"]
    assert cfg.job.config_file == str(toml_file)


def test_cli_overrides_beat_toml(toml_file):
    cfg = load_config(
        Root,
        [
            "--job.config_file",
            str(toml_file),
            "--training.steps",
            "7",
            "--parallelism.tensor_parallel_degree=2",
            "--quantize.linear.float8.filter_fqns",
            "a,b",
        ],
    )
    assert cfg.training.steps == 7
    assert cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.quantize.linear.float8.filter_fqns == ["a", "b"]
    assert cfg.training.seq_len == 8192  # untouched TOML value survives


def test_cli_booleans_lists_and_none():
    cfg = load_config(
        Root,
        [
            "--training.compile",
            "--model.converters",
            '["x", "y"]',
            "--training.dataset_path",
            "none",
        ],
    )
    assert cfg.training.compile is True
    assert cfg.model.converters == ["x", "y"]
    assert cfg.training.dataset_path is None
    cfg = load_config(Root, ["--training.compile", "false", "--model.converters", ""])
    assert cfg.training.compile is False and cfg.model.converters == []
    cfg = load_config(Root, ["--training.compile", "--training.steps", "3"])
    assert cfg.training.compile is True and cfg.training.steps == 3


def test_round_trip_toml_dataclass_toml_is_identical(toml_file, tmp_path):
    cfg = load_config(Root, ["--job.config_file", str(toml_file), "--training.compile"])
    text = to_toml(cfg)
    dumped = tmp_path / "resolved.toml"
    dumped.write_text(text)
    again = load_config(Root, toml_path=dumped)
    assert again == cfg
    assert to_toml(again) == text


def test_round_trip_keeps_special_strings_and_floats(tmp_path):
    cfg = dataclasses.replace(Root())
    cfg.job.description = 'quotes " and \\ backslash and ünïcode'
    cfg.training.max_norm = 1e-12
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(Root, toml_path=path) == cfg


def test_help_lists_every_option_with_default_and_doc():
    text = render_help(Root)
    for option, default, doc in [
        ("--training.steps int", "(default: 10)", "Optimizer steps to run."),
        (
            "--quantize.linear.float8.filter_fqns list[str]",
            '(default: ["output"])',
            "Modules left in high precision.",
        ),
        ('--job.device one of "auto", "cuda", "cpu"', '(default: "auto")', "Where to compute"),
        ("--training.dataset_path str or none", "(default: none)", "Local copy of the dataset."),
    ]:
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(option))
        assert default in line
        assert doc in text.split(line, 1)[1].splitlines()[1]


# Each bad input and the exact message a user sees.
BAD_INPUTS = [
    (
        "unknown section",
        ["--paralelism.tensor_parallel_degree", "2"],
        "titan: config error: unknown section [paralelism] (from --paralelism.tensor_parallel_degree)\n"
        "       did you mean parallelism?",
    ),
    (
        "misspelled key",
        ["--parallelism.tensor_parallel_degre", "2"],
        "titan: config error: unknown key [parallelism] tensor_parallel_degre (from --parallelism.tensor_parallel_degre)\n"
        "       did you mean tensor_parallel_degree?",
    ),
    (
        "unknown key with no close match",
        ["--training.zzz", "1"],
        "titan: config error: unknown key [training] zzz (from --training.zzz)",
    ),
    (
        "wrong type on the CLI",
        ["--training.steps", "ten"],
        'titan: config error: [training] steps = "ten" is not valid (from --training.steps)\n'
        "       expected an integer; the type is int",
    ),
    (
        "value outside a Literal",
        ["--training.mixed_precision_param", "fp8"],
        'titan: config error: [training] mixed_precision_param = "fp8" is not valid (from --training.mixed_precision_param)\n'
        '       allowed: "bfloat16", "float32"',
    ),
    (
        "bad boolean",
        ["--training.compile", "maybe"],
        'titan: config error: [training] compile = "maybe" is not valid (from --training.compile)\n'
        "       expected true or false; the type is bool",
    ),
    (
        "section given a value",
        ["--training", "3"],
        "titan: config error: training is a section, not a value (from --training)\n"
        "       set its keys instead, e.g. --training.<key> VALUE",
    ),
    (
        "a section's own validation",
        ["--training.steps", "0"],
        "titan: config error: [training] steps = 0 is not valid\n       run at least 1 step",
    ),
    (
        "negative timeout in a titan-core section",
        ["--comm.init_timeout_seconds", "-5"],
        "titan: config error: [comm] init_timeout_seconds = -5 is not valid\n"
        "       use a positive number of seconds",
    ),
    (
        "missing value",
        ["--training.steps"],
        "titan: config error: --training.steps needs a value",
    ),
    (
        "positional argument",
        ["train.toml"],
        "titan: config error: unexpected argument 'train.toml'\n"
        "       options look like --section.key VALUE",
    ),
    (
        "missing config file",
        ["--job.config_file", "/nonexistent/run.toml"],
        "titan: config error: config file '/nonexistent/run.toml' does not exist\n"
        "       pass an existing TOML file",
    ),
]


@pytest.mark.parametrize(
    "args,expected", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_cli_input_gives_exact_message(args, expected):
    assert config_error(Root, args) == expected


def test_bad_toml_types_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[training]\nsteps = "100"\nmax_norm = true\n[model]\nconverters = "float8"\n')
    assert config_error(Root, toml_path=path) == (
        'titan: config error: [training] steps = "100" is not valid (from bad.toml)\n'
        "       expected an integer; the type is int\n"
        "titan: config error: [training] max_norm = true is not valid (from bad.toml)\n"
        "       expected a number; the type is float\n"
        'titan: config error: [model] converters = "float8" is not valid (from bad.toml)\n'
        "       expected a list; the type is list[str]"
    )


def test_invalid_toml_syntax_is_a_config_error(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[training\nsteps = 1\n")
    assert config_error(Root, toml_path=path).startswith(
        f"titan: config error: {path} is not valid TOML"
    )


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(Root, ["--training.stepz", "1", "--model.nam", "x"])
    assert len(info.value.problems) == 2


def test_an_application_maps_config_file_names_to_files(toml_file):
    def find(given: str):
        if given == "named-run":
            return toml_file
        raise ConfigError(f"no config named {given!r}\nknown: named-run")

    cfg = load_config(Root, ["--job.config_file", "named-run"], find_config_file=find)
    assert cfg.training.steps == 100 and cfg.job.config_file == "named-run"
    with pytest.raises(ConfigError, match="no config named 'other'"):
        load_config(Root, ["--job.config_file", "other"], find_config_file=find)
    # Without a finder the value is a path, as before.
    assert "does not exist" in config_error(Root, ["--job.config_file", "named-run"])


@dataclasses.dataclass
class _CompatTrain:
    seed: int = 0
    """Seed."""
    steps: int = 1
    """Steps."""


@dataclasses.dataclass
class _CompatRoot:
    __config_compat__ = ConfigCompat(
        aliases={"debug.seed": "train.seed"},
        unimplemented={"train.fancy", "extra.thing"},
        renamed={"train.n_steps": "train.steps"},
    )
    train: _CompatTrain = dataclasses.field(default_factory=_CompatTrain)


def test_config_compat_aliases_warns_once_for_unimplemented_and_names_renamed_keys(
    tmp_path, caplog
):
    import logging

    path = tmp_path / "c.toml"
    path.write_text("[debug]\nseed = 5\n[train]\nfancy = true\n[extra]\nthing = 1\n")
    with caplog.at_level(logging.WARNING, logger="titan"):
        cfg = load_config(_CompatRoot, toml_path=path)
    assert cfg.train.seed == 5
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("titan")]
    assert messages == ["ignoring keys Titan does not implement: [train] fancy, [extra] thing"]
    with pytest.raises(
        ConfigError, match=r"\[train\] n_steps was renamed \(from --train.n_steps\)"
    ):
        load_config(_CompatRoot, ["--train.n_steps", "3"])


@dataclasses.dataclass
class _Limits:
    scale: float = 1.0
    """A plain float."""
    weights: list[float] = dataclasses.field(default_factory=list)
    """Floats in a list."""
    limit: float = allow_nonfinite(math.inf)
    """inf means no limit."""


@dataclasses.dataclass
class _LimitsRoot:
    limits: _Limits = dataclasses.field(default_factory=_Limits)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", "Infinity", "1e999"])
def test_a_float_key_refuses_nan_and_inf_on_the_command_line(text):
    assert config_error(Root, ["--training.max_norm", text]) == (
        f'titan: config error: [training] max_norm = "{text}" is not valid (from --training.max_norm)\n'
        "       expected a finite number; the type is float"
    )
    assert "expected a finite number" in config_error(
        _LimitsRoot, ["--limits.weights", f"1,{text}"]
    )


def test_a_float_key_refuses_nan_and_inf_in_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[limits]\nscale = nan\nweights = [1.0, -inf]\nlimit = inf\n")
    assert config_error(_LimitsRoot, toml_path=path) == (
        "titan: config error: [limits] scale = nan is not valid (from c.toml)\n"
        "       expected a finite number; the type is float\n"
        "titan: config error: [limits] weights = [1.0, -inf] is not valid (from c.toml)\n"
        "       expected a finite number; the type is list[float]"
    )


def test_a_key_declared_with_allow_nonfinite_takes_inf_and_round_trips(tmp_path):
    cfg = load_config(_LimitsRoot, ["--limits.limit", "inf"])
    assert cfg.limits.limit == math.inf
    assert load_config(_LimitsRoot, ["--limits.limit", "2.5"]).limits.limit == 2.5
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert "limit = inf" in path.read_text()
    assert load_config(_LimitsRoot, toml_path=path) == cfg


@dataclasses.dataclass
class _ValuesTrain:
    converters: list[str] = dataclasses.field(default_factory=list)
    """Converters."""
    kind: str = "new"
    """Kind."""


@dataclasses.dataclass
class _ValuesRoot:
    __config_compat__ = ConfigCompat(
        values={"train.converters": {"old": "new.name"}, "train.kind": {"legacy": "new"}}
    )
    train: _ValuesTrain = dataclasses.field(default_factory=_ValuesTrain)


def test_config_compat_reads_older_value_names_with_a_notice(tmp_path, caplog):
    import logging

    path = tmp_path / "v.toml"
    path.write_text('[train]\nconverters = ["old", "other"]\nkind = "legacy"\n')
    with caplog.at_level(logging.INFO, logger="titan"):
        cfg = load_config(_ValuesRoot, toml_path=path)
    assert cfg.train.converters == ["new.name", "other"] and cfg.train.kind == "new"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("titan")] == [
        '[train] converters = "old" (from v.toml) is an older name; read as "new.name"',
        '[train] kind = "legacy" (from v.toml) is an older name; read as "new"',
    ]
    cfg = load_config(_ValuesRoot, ["--train.converters", "other,old"])
    assert cfg.train.converters == ["other", "new.name"]


def test_a_boolean_is_turned_off_by_its_negated_flag():
    for flag in ("--training.no-compile", "--training.no_compile", "--no-training.compile"):
        cfg = load_config(Root, ["--training.compile", flag, "--training.steps", "3"])
        assert cfg.training.compile is False and cfg.training.steps == 3, flag
    # Only booleans: a negated name of anything else is an unknown key, as before.
    assert "unknown key [training] no-steps" in config_error(Root, ["--training.no-steps", "3"])


def test_a_config_error_from_a_worker_process_keeps_its_problems():
    import pickle

    error = pickle.loads(pickle.dumps(ConfigError(["one\nfix it", "two"])))
    assert error.problems == ["one\nfix it", "two"]
    assert str(error).count("titan: config error:") == 2
