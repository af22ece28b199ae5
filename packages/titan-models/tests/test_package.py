import re
from importlib.metadata import entry_points
from pathlib import Path

import titan_models
from titan_models import llama3_spec

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    (example,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    exec(compile(example, str(README), "exec"), {})


def test_llama3_is_registered_under_the_titan_models_entry_point():
    (ep,) = [ep for ep in entry_points(group="titan.models") if ep.name == "llama3"]
    assert ep.load() is llama3_spec
    assert llama3_spec.name == "llama3" and "debugmodel" in llama3_spec.flavors


def test_readme_flavor_table_lists_every_flavor_with_its_exact_size():
    text = README.read_text()
    for name, args in llama3_spec.flavors.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"{titan_models.llama_param_count(args):,}" in row, name
