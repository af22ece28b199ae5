from __future__ import annotations

import sys

import pytest

from titan_core import PluginError, available, resolve
from titan_core.config import ConfigError


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A real installed distribution with an entry point: a dist-info folder on sys.path."""
    (tmp_path / "acme_ckpt.py").write_text("class Saver:\n    kind = 'acme'\n")
    info = tmp_path / "acme_ckpt-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-ckpt\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[titan.test_group]\nacme = acme_ckpt:Saver\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("acme_ckpt", None)


def test_entry_point_plugins_are_found_by_name(installed_plugin):
    assert available("titan.test_group") == {"acme": "acme_ckpt:Saver"}
    assert resolve("titan.test_group", "acme").kind == "acme"


def test_module_attr_paths_need_no_registration():
    assert resolve("titan.models", "titan_core.config:ConfigError") is ConfigError


def test_unknown_plugin_lists_what_is_installed(installed_plugin):
    with pytest.raises(PluginError) as info:
        resolve("titan.test_group", "acm")
    assert str(info.value) == (
        "no titan.test_group plugin named 'acm'; installed: acme\n"
        "did you mean acme?\n"
        "install a package that registers it under the entry-point group 'titan.test_group', "
        "or give an import path as module:attr"
    )


def test_bad_import_paths_say_what_failed():
    with pytest.raises(PluginError, match="cannot import 'no_such_module'"):
        resolve("titan.data", "no_such_module:thing")
    with pytest.raises(PluginError, match="has no attribute 'nothing'"):
        resolve("titan.data", "titan_core:nothing")


def test_parallelizable_problems_names_what_a_model_lacks():
    from torch import nn

    from titan_core import parallelizable_problems

    class Partial(nn.Module):
        pre_blocks = ("embed",)

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"0": nn.Linear(2, 2)})

        def tp_plan(self):
            return None

    assert parallelizable_problems(Partial()) == [
        "`post_blocks` is not a tuple of module names",
        "`cp_buffers()` is missing",
        "`init_weights()` is missing",
        "`flops_per_token()` is missing",
    ]
    assert parallelizable_problems(nn.Linear(2, 2))[0].startswith("`layers`")
