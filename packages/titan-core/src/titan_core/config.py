"""Config machinery: dataclass sections, loaded from TOML and overridden by `--section.key value`.

A run's config is a tree of dataclasses. The root's fields are sections (`job`, `training`, ...);
a section may nest further sections (`quantize.linear.float8`). Each package owns the dataclass
of its own sections; this module only knows how to load, merge, check, print and dump them.

Precedence is CLI > TOML > defaults. Every problem is reported at once, before any work
starts, as a `ConfigError` naming the key, the value, what is allowed and, where a name is
close, what the user probably meant.

A field's docstring (the string literal right under it) is its `--help` text. A float field
takes finite numbers only (`nan` and `inf` parse as floats, in TOML and on the command line,
and would reach the run as a number); a field where inf or nan means something is declared with
`allow_nonfinite(default)`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import textwrap
import tomllib
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")

CONFIG_FILE_FLAGS = ("--job.config_file", "--config")

_NONFINITE_OK = "titan_allow_nonfinite"


def allow_nonfinite(default: Any) -> Any:
    """A float field (or list of floats) that also takes nan, inf and -inf, for a setting where
    one of them means something (say inf for "no limit"): `limit: float = allow_nonfinite(inf)`.
    Every other float field refuses them."""
    return dataclasses.field(default=default, metadata={_NONFINITE_OK: True})


@dataclasses.dataclass(frozen=True)
class ConfigCompat:
    """Keys another tool's config files use (a root config class sets `__config_compat__`).

    `aliases`: that tool's name -> ours; the value is used as if set under our name.
    `unimplemented`: keys it knows and we do not implement; a file setting them loads, with one
    warning naming them. `renamed`: names it used to have -> what to write now; an error.
    `values`: for a key, that tool's older names of values -> ours (for a list, of its
    elements); the value is read as ours, with one notice line.
    All names are dotted (`section.key`).
    """

    aliases: typing.Mapping[str, str] = dataclasses.field(default_factory=dict)
    unimplemented: typing.Collection[str] = frozenset()
    renamed: typing.Mapping[str, str] = dataclasses.field(default_factory=dict)
    values: typing.Mapping[str, typing.Mapping[str, str]] = dataclasses.field(default_factory=dict)


class ConfigError(ValueError):
    """One or more config problems. `str()` is the message a user sees, one problem per
    paragraph, each line already prefixed for the terminal."""

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self.render())

    def __reduce__(self):
        # Rebuilt from its problems (a worker process sends it back pickled): built from the
        # rendered text it would be prefixed a second time.
        return (type(self), (self.problems,))

    def render(self) -> str:
        out = []
        for problem in self.problems:
            first, *rest = problem.split("\n")
            out.append("titan: config error: " + first)
            out.extend("       " + line for line in rest)
        return "\n".join(out)


# ----------------------------------------------------------------------------- introspection


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field of a dataclass (PEP 257 attribute docstrings)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def describe_type(tp: Any) -> str:
    """A short, user-facing name of a field type: `int`, `bool`, `list[str]`, `one of a, b`."""
    tp, optional = _strip_optional(tp)
    if typing.get_origin(tp) is Literal:
        text = "one of " + ", ".join(_show(v) for v in typing.get_args(tp))
    elif typing.get_origin(tp) in (list, tuple):
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        text = f"list[{describe_type(inner)}]"
    else:
        text = getattr(tp, "__name__", str(tp))
    return text + (" or none" if optional else "")


def _show(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


# ----------------------------------------------------------------------------- coercion


class _BadValue(Exception):
    pass


def _coerce(value: Any, tp: Any, from_cli: bool, finite: bool = True) -> Any:
    """Turn a TOML value (typed) or a CLI string into a value of type `tp`, or raise _BadValue.
    With `finite`, a float must be finite."""
    tp, optional = _strip_optional(tp)
    if optional and (value is None or (from_cli and value.lower() in ("none", "null"))):
        return None
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            try:
                candidate = _coerce(value, type(choice), from_cli)
            except _BadValue:
                continue
            if candidate == choice:
                return choice
        raise _BadValue(f"allowed: {', '.join(_show(c) for c in choices)}")
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        if from_cli:
            text = value.strip()
            if text.startswith("["):
                try:
                    items = json.loads(text)
                except json.JSONDecodeError as e:
                    raise _BadValue(f"expected a list such as [1, 2] or a,b ({e.msg})") from None
                return [_coerce(v, inner, False, finite) for v in items]
            items = [s.strip() for s in text.split(",")] if text else []
            return [_coerce(v, inner, True, finite) for v in items]
        if not isinstance(value, list):
            raise _BadValue("expected a list")
        return [_coerce(v, inner, False, finite) for v in value]
    if tp is bool:
        if from_cli:
            lowered = value.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
        elif isinstance(value, bool):
            return value
        raise _BadValue("expected true or false")
    if tp is int:
        if from_cli:
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise _BadValue("expected an integer") from None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _BadValue("expected an integer")
    if tp is float:
        if from_cli:
            try:
                number = float(value)
            except ValueError:
                raise _BadValue("expected a number") from None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise _BadValue("expected a number")
        if finite and not math.isfinite(number):
            raise _BadValue("expected a finite number")
        return number
    if tp is str:
        if from_cli or isinstance(value, str):
            return value
        raise _BadValue("expected a string")
    if tp is Any:
        return value
    raise TypeError(f"config fields of type {tp!r} are not supported")


# ----------------------------------------------------------------------------- loading


@dataclasses.dataclass
class _Raw:
    value: Any
    source: str  # "--a.b" or "file.toml" (for messages)
    from_cli: bool


def _suggest(name: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"\ndid you mean {close[0]}?" if close else ""


def _section_label(path: Sequence[str]) -> str:
    return "[" + ".".join(path) + "]" if path else "the top level"


def _build(cls: type[T], raw: dict[str, Any], path: tuple[str, ...], problems: list[str]) -> T:
    """Instantiate `cls` from defaults overlaid with `raw` (nested dicts of _Raw leaves)."""
    fields = _fields(cls)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for key, item in raw.items():
        if key not in fields:
            where = _where(item)
            kind = "section" if isinstance(item, dict) and not path else "key"
            label = (
                f"[{'.'.join((*path, key))}]"
                if kind == "section"
                else f"{_section_label(path)} {key}"
            )
            problems.append(f"unknown {kind} {label}{where}{_suggest(key, list(fields))}")
            continue
        tp = hints[key]
        if _is_section(tp):
            if not isinstance(item, dict):
                problems.append(
                    f"{'.'.join((*path, key))} is a section, not a value{_where(item)}\n"
                    f"set its keys instead, e.g. --{'.'.join((*path, key))}.<key> VALUE"
                )
                continue
            kwargs[key] = _build(tp, item, (*path, key), problems)
            continue
        if isinstance(item, dict):
            problems.append(f"{_section_label(path)} {key} is a value, not a section{_where(item)}")
            continue
        try:
            finite = not fields[key].metadata.get(_NONFINITE_OK, False)
            kwargs[key] = _coerce(item.value, tp, item.from_cli, finite)
        except _BadValue as e:
            shown = json.dumps(item.value) if item.from_cli else _show(item.value)
            reason = (
                str(e) if str(e).startswith("allowed") else f"{e}; the type is {describe_type(tp)}"
            )
            problems.append(
                f"{_section_label(path)} {key} = {shown} is not valid{_where(item)}\n{reason}"
            )
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's __post_init__ may check its own values
        problems.extend(e.problems)
        return cls()


def _where(item: Any) -> str:
    if isinstance(item, _Raw):
        return f" (from {item.source})"
    if isinstance(item, dict):
        leaves = list(_leaves(item))
        return f" (from {leaves[0].source})" if leaves else ""
    return ""


def _leaves(tree: dict[str, Any]):
    for value in tree.values():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield value


def _from_toml(data: dict[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        out[key] = (
            _from_toml(value, source) if isinstance(value, dict) else _Raw(value, source, False)
        )
    return out


def _parse_cli(args: Sequence[str], root: type) -> tuple[dict[str, Any], list[str]]:
    """`--a.b.c VALUE`, `--a.b.c=VALUE`, bare `--a.b.flag` for a boolean true, and
    `--a.b.no-flag` (or `--a.b.no_flag`, `--no-a.b.flag`) for false."""
    tree: dict[str, Any] = {}
    problems: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            problems.append(f"unexpected argument {arg!r}\noptions look like --section.key VALUE")
            continue
        name, eq, value = arg[2:].partition("=")
        negated = None if eq else _negated_bool(root, name)
        if negated is not None:
            name, value = negated, "false"
        elif not eq:
            takes_value = not _is_bool_field(root, name.split("."))
            if i < len(args) and (takes_value or not args[i].startswith("--")):
                value = args[i]
                i += 1
            elif takes_value:
                problems.append(f"--{name} needs a value")
                continue
            else:
                value = "true"
        parts = name.split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"--{name} conflicts with another option")
                break
        else:
            node[parts[-1]] = _Raw(value, f"--{name}", True)
    return tree, problems


def _negated_bool(root: type, name: str) -> str | None:
    """The boolean option that `section.no-key`, `section.no_key` or `no-section.key` turns
    off (torchtitan's command line spells false so), or None."""
    if _is_bool_field(root, name.split(".")):
        return None
    head, _, last = name.rpartition(".")
    for prefix in ("no-", "no_"):
        candidates = [name.removeprefix(prefix)] if name.startswith(prefix) else []
        if last.startswith(prefix):
            candidates.append(f"{head}.{last.removeprefix(prefix)}" if head else "")
        for candidate in candidates:
            if candidate and _is_bool_field(root, candidate.split(".")):
                return candidate
    return None


def _is_bool_field(root: type, parts: list[str]) -> bool:
    cls: Any = root
    for part in parts:
        if not _is_section(cls) or part not in _fields(cls):
            return False
        cls = _hints(cls)[part]
    return _strip_optional(cls)[0] is bool


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    cls: type[T],
    args: Sequence[str] = (),
    *,
    toml_path: str | Path | None = None,
    find_config_file: Callable[[str], Path] | None = None,
) -> T:
    """Build a `cls` config from its defaults, a TOML file and `--section.key value` overrides.

    The TOML file comes from `toml_path` or from `--job.config_file PATH` among `args`;
    `find_config_file`, when given, turns that value into the file to read (an application
    finds the configs it ships by name this way) and raises `ConfigError` when there is none.
    Raises `ConfigError` listing every problem found.
    """
    args = list(args)
    for flag in CONFIG_FILE_FLAGS:
        for i, arg in enumerate(args):
            if arg == flag and i + 1 < len(args):
                toml_path = args[i + 1]
                if flag != "--job.config_file":
                    del args[i : i + 2]
                break
            if arg.startswith(flag + "="):
                toml_path = arg.split("=", 1)[1]
                if flag != "--job.config_file":
                    del args[i]
                break
    raw: dict[str, Any] = {}
    if toml_path is not None:
        path = Path(toml_path) if find_config_file is None else find_config_file(str(toml_path))
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist\npass an existing TOML file"
            )
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        raw = _from_toml(data, path.name)
    cli, problems = _parse_cli(args, cls)
    raw = _merge(raw, cli)
    compat = getattr(cls, "__config_compat__", None)
    if compat is not None:
        raw = _apply_compat(raw, compat, problems)
    config = _build(cls, raw, (), problems)
    if not problems:
        problems.extend(validate(config))
    if problems:
        raise ConfigError(problems)
    return config


def _apply_compat(raw: dict[str, Any], compat: ConfigCompat, problems: list[str]) -> dict[str, Any]:
    """Move aliased keys to our names, drop (and name once) unimplemented ones, and turn
    renamed ones into problems saying what to write instead."""
    from titan_core.log import get_logger

    leaves = list(_dotted_leaves(raw))
    ignored = []
    for dotted, item in leaves:
        if dotted in compat.aliases:
            target = compat.aliases[dotted]
            _pop(raw, dotted)
            if _lookup(raw, target) is not None:
                problems.append(
                    f"both {dotted} and {target} are set{_where(item)}\nthey are one setting; keep {target}"
                )
            else:
                _put(raw, target, item)
        elif dotted in compat.unimplemented:
            _pop(raw, dotted)
            ignored.append(_label(dotted))
        elif dotted in compat.renamed:
            _pop(raw, dotted)
            problems.append(
                f"{_label(dotted)} was renamed{_where(item)}\nuse {compat.renamed[dotted]}"
            )
    if ignored:
        get_logger("config").warning(
            "ignoring keys Titan does not implement: %s", ", ".join(ignored)
        )
    for dotted, renames in compat.values.items():
        item = _lookup(raw, dotted)
        if isinstance(item, _Raw):
            _rename_values(item, dotted, renames)
    return raw


def _rename_values(item: _Raw, dotted: str, renames: typing.Mapping[str, str]) -> None:
    """Read another tool's older value names (`converters = ["float8"]`) as ours, with a
    notice. A list from the command line (`a,b`) is renamed element by element."""
    from titan_core.log import get_logger

    value = item.value
    if item.from_cli and not value.strip().startswith("["):
        elements = [s.strip() for s in value.split(",")]
        new: Any = ",".join(renames.get(v, v) for v in elements)
    elif isinstance(value, list):
        elements = value
        new = [renames.get(v, v) if isinstance(v, str) else v for v in value]
    elif isinstance(value, str):
        elements, new = [value], renames.get(value, value)
    else:
        return
    for old in sorted({v for v in elements if isinstance(v, str) and v in renames}):
        get_logger("config").info(
            "%s = %s (from %s) is an older name; read as %s",
            _label(dotted),
            json.dumps(old),
            item.source,
            json.dumps(renames[old]),
        )
    item.value = new


def _label(dotted: str) -> str:
    head, _, key = dotted.rpartition(".")
    return f"[{head}] {key}" if head else key


def _dotted_leaves(tree: dict[str, Any], path: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _dotted_leaves(value, (*path, key))
        else:
            yield ".".join((*path, key)), value


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _pop(tree: dict[str, Any], dotted: str) -> None:
    *heads, last = dotted.split(".")
    chain = [tree]
    for part in heads:
        chain.append(chain[-1][part])
    del chain[-1][last]
    for parent, part in zip(reversed(chain[:-1]), reversed(heads)):
        if not parent[part]:  # a section left empty goes too
            del parent[part]


def _put(tree: dict[str, Any], dotted: str, item: Any) -> None:
    *heads, last = dotted.split(".")
    node = tree
    for part in heads:
        node = node.setdefault(part, {})
    node[last] = item


def validate(config: Any) -> list[str]:
    """Run every section's `validate()` (if it has one), deepest first, then the root's.

    A `validate()` returns a list of problems (or raises ConfigError); it is where a section
    checks combinations of its own keys. Cross-section checks belong on the root.
    """
    problems: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            problems.extend(validate(value))
    check = getattr(config, "validate", None)
    if callable(check):
        try:
            problems.extend(check() or [])
        except ConfigError as e:
            problems.extend(e.problems)
    return problems


# ----------------------------------------------------------------------------- help and dump


def iter_options(cls: type, path: tuple[str, ...] = ()):
    """Yield (dotted name, type, default, doc) for every leaf option under `cls`."""
    hints = _hints(cls)
    docs = field_docs(cls)
    for name, f in _fields(cls).items():
        tp = hints[name]
        if _is_section(tp):
            yield from iter_options(tp, (*path, name))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        yield ".".join((*path, name)), tp, default, docs.get(name, "")


def render_help(cls: type, prog: str = "titan-train") -> str:
    """`--help` text: every option with its type, default and the first line of its doc."""
    lines = [
        f"usage: {prog} [--job.config_file FILE.toml] [--section.key VALUE ...]",
        "",
        "Options come from defaults, then the TOML file, then the command line (which wins).",
        "Booleans: --section.flag (true), --section.no-flag or --section.flag false.",
        "Lists: a,b,c or [1, 2].",
    ]
    section = None
    for name, tp, default, doc in iter_options(cls):
        head = name.rsplit(".", 1)[0] if "." in name else ""
        if head != section:
            section = head
            lines += ["", f"[{head}]" if head else "[top level]"]
        shown = "(required)" if default is dataclasses.MISSING else f"(default: {_show(default)})"
        lines.append(f"  --{name} {describe_type(tp)} {shown}")
        summary = doc.split("\n\n")[0].replace("\n", " ").strip()
        if summary:
            lines.append("      " + summary)
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def to_toml(config: Any) -> str:
    """Dump a config tree to TOML; `load_config(type(c), toml_path=...)` reads it back equal.

    Keys whose value is None are left out (TOML has no null), which reads back as the field's
    default; `Optional` fields must therefore default to None.
    """
    out: list[str] = []

    def emit(obj: Any, path: tuple[str, ...]) -> None:
        leaves, sections = [], []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            (sections if dataclasses.is_dataclass(value) else leaves).append((f.name, value))
        present = [(k, v) for k, v in leaves if v is not None]
        if path and (present or not sections):
            out.append(f"\n[{'.'.join(path)}]")
        out.extend(f"{k} = {_toml_value(v)}" for k, v in present)
        for name, value in sections:
            emit(value, (*path, name))

    emit(config, ())
    return "\n".join(out).lstrip("\n") + "\n"


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain nested dict of the config, for logging and checkpoints."""
    return dataclasses.asdict(config)
