"""Messages and docs that tell a user to set a config key name one that exists: every
`--section.key`, `[section] key` and `set key` in the sources' strings (messages, docstrings)
and in the repository's Markdown is checked against the trainer's config schema."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from titan_core.config import iter_options
from titan_trainer.config import JobConfig
from titan_trainer.torchtitan_keys import UNIMPLEMENTED

REPO = Path(__file__).resolve().parents[3]

LEAVES = {name for name, *_ in iter_options(JobConfig)}
SECTIONS = {".".join(name.split(".")[:i]) for name in LEAVES for i in range(1, name.count(".") + 1)}
TOP = {s.split(".")[0] for s in SECTIONS}
KEY_NAMES = {name.rsplit(".", 1)[-1] for name in LEAVES}

FLAG = re.compile(r"--([a-z_][a-z0-9_]*(?:\.[a-z0-9_-]+)+)")
# A boolean's negated flag names the key: --section.no-key (or no_key).
NEGATED = re.compile(r"\.no[-_]([a-z0-9_]+)$")
# `[section] word`: a key when it has an underscore or a value follows; else prose
# ("[lr_scheduler] is not applied").
PAIR = re.compile(r"\[([a-z_][a-z0-9_.]*)\] ([a-z_][a-z0-9_]*)( =)?")
# `set key` (not `--set`): a dotted key, or a bare name with an underscore.
SET = re.compile(r"(?<![-\w])set ([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)")

# Mentions of keys that do not exist on purpose: (file, mention) -> why.
ON_PURPOSE = {
    ("packages/titan-core/README.md", "--training.step"): "shows the error for a misspelled key",
}


def wrong_keys(text: str) -> list[str]:
    found = []
    for m in FLAG.finditer(text):
        key = NEGATED.sub(r".\1", m.group(1))
        if key.split(".")[0] in TOP and key not in LEAVES | SECTIONS:
            found.append(m.group(0))
    for m in PAIR.finditer(text):
        section, word = m.group(1), m.group(2)
        key = f"{section}.{word}"
        if key in UNIMPLEMENTED:  # torchtitan's, named as keys a torchtitan TOML may set
            continue
        if section in SECTIONS and key not in LEAVES and ("_" in word or m[3]):
            found.append(m.group(0))
    for m in SET.finditer(text):
        key = m.group(1)
        known = key in LEAVES if "." in key else ("_" not in key or key in KEY_NAMES)
        if not known:
            found.append(m.group(0))
    return found


def _strings(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield f"{path.relative_to(REPO)}:{node.lineno}", node.value


def _texts():
    for path in sorted([*REPO.glob("packages/*/src/**/*.py"), *REPO.glob("apps/*/src/**/*.py")]):
        yield from _strings(path)
    for path in sorted(REPO.glob("**/*.md")):
        if not {".venv", ".nox", "node_modules"} & set(path.relative_to(REPO).parts):
            yield str(path.relative_to(REPO)), path.read_text()


def test_the_check_finds_keys_that_do_not_exist():
    assert wrong_keys("unknown: set --training.text_field, or [training] text_field = 'x'") == [
        "--training.text_field",
        "[training] text_field =",
    ]
    assert wrong_keys("set text_field to the field that holds the text") == ["set text_field"]
    assert wrong_keys("train with [model] load_balance_coeff off") == ["[model] load_balance_coeff"]
    ok = "set [training] dataset_text_field, --training.steps, [lr_scheduler] is not applied"
    assert wrong_keys(ok + ', set bad_rows = "skip", set dry_run.device_memory_gib') == []
    assert wrong_keys("--checkpoint.no-enable, --compile.no_enable") == []
    assert wrong_keys("--checkpoint.no-such-key") == ["--checkpoint.no-such-key"]


def test_every_key_a_message_or_doc_names_exists():
    wrong = [
        f"{where}: {mention}"
        for where, text in _texts()
        for mention in wrong_keys(text)
        if (where.split(":")[0], mention) not in ON_PURPOSE
    ]
    assert not wrong, "keys that do not exist:\n" + "\n".join(wrong)
