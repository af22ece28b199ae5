"""Lists of tables (`list[SomeDataclass]` fields): TOML's arrays of tables, a JSON list on the
command line that replaces the file's, per-table checks with the table's number in the
message, `--help` listing the table's keys, and a TOML dump that reads back equal."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from titan_core import ConfigError, load_config, render_help, to_toml


@dataclass
class Group:
    params: str = ""
    """Regex over parameter names."""
    lr: float | None = None
    """The group's learning rate; none: the section's."""
    frozen: bool = False
    """Leave the group untouched."""

    def validate(self) -> list[str]:
        return [] if self.params else ["a group needs params\nname the parameters"]


@dataclass
class Optimizer:
    lr: float = 1e-3
    """Learning rate."""
    groups: list[Group] = field(default_factory=list)
    """Parameter groups, first match wins."""


@dataclass
class Sub:
    depth: int = 1
    """A subsection after the tables."""


@dataclass
class Section:
    optimizer: Optimizer = field(default_factory=Optimizer)
    sub: Sub = field(default_factory=Sub)


@dataclass
class Root:
    optimizer: Optimizer = field(default_factory=Optimizer)
    nested: Section = field(default_factory=Section)


TOML = """
[optimizer]
lr = 0.01

[[optimizer.groups]]
params = "norm"
lr = 0.0

[[optimizer.groups]]
params = "^layers\\\\.0\\\\."
frozen = true

[nested.optimizer]
lr = 0.5

[[nested.optimizer.groups]]
params = "x"
"""


def test_arrays_of_tables_load_from_toml_and_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    cfg = load_config(Root, [], toml_path=path)
    assert cfg.optimizer.lr == 0.01
    assert cfg.optimizer.groups == [Group("norm", 0.0), Group(r"^layers\.0\.", None, True)]
    assert cfg.nested.optimizer.groups == [Group("x")]
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(to_toml(cfg))
    assert "[[optimizer.groups]]" in dumped.read_text()
    assert load_config(Root, [], toml_path=dumped) == cfg


def test_a_json_list_on_the_command_line_replaces_the_files(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    cfg = load_config(Root, ["--optimizer.groups", '[{"params": "bias", "lr": 1}]'], toml_path=path)
    assert cfg.optimizer.groups == [Group("bias", 1.0)]
    assert load_config(Root, ["--optimizer.groups", "[]"], toml_path=path).optimizer.groups == []


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--optimizer.groups", '[{"params": "a", "lrr": 1}]'],
            "unknown key [optimizer.groups #1] lrr (from --optimizer.groups)\n"
            "       did you mean lr?",
        ),
        (
            ["--optimizer.groups", '[{"params": "a"}, {"params": "b", "frozen": "yes"}]'],
            '[optimizer.groups #2] frozen = "yes" is not valid (from --optimizer.groups)',
        ),
        (
            ["--optimizer.groups", "[{params: a}]"],
            '--optimizer.groups = "[{params: a}]" is not valid JSON',
        ),
        (
            ["--optimizer.groups", '{"params": "a"}'],
            "[[optimizer.groups]] must be a list of tables",
        ),
        (["--optimizer.groups", '[{"lr": 1}]'], "a group needs params"),
    ],
)
def test_bad_tables_are_config_errors_naming_the_table(args, expected):
    with pytest.raises(ConfigError) as e:
        load_config(Root, args)
    assert expected in str(e.value), str(e.value)


def test_help_lists_the_tables_keys():
    text = render_help(Root)
    assert (
        "--optimizer.groups list of [[optimizer.groups]] tables (JSON here) (default: [])" in text
    )
    assert '      params str (default: "")' in text
    assert "          Regex over parameter names." in text
    assert "      lr float or none (default: none)" in text
