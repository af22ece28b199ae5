"""A package's public API as text, read from its sources (no import, so any commit of the
repository can be read, and nothing needs torch): what `tools/release.py` compares between a
release and now.

The public names are the package's `__all__`; each is found where its `__init__.py` takes it
from (`from M import N`, eager or in an `if TYPE_CHECKING:` block, or an `_EXPORTS` table of
name -> module), and described by its definition there:

- a function: its parameters (name, kind, whether it has a default), in order;
- a class: its bases, its public methods as functions, and its annotated attributes (the
  fields of a dataclass, the members of a Protocol) with their annotation;
- anything else (a constant, a re-exported name the module imports itself): its name.

Two descriptions of one name are compatible when every caller of the old one still works
with the new one: nothing removed or renamed, no parameter that had a default loses it, no new
parameter without a default, no annotation changed. Anything else is breaking.
"""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

Reader = Callable[[str], str | None]
"""Reads a file of the repository by its path from the root (None when it has none)."""


def working_tree(root: Path) -> Reader:
    def read(path: str) -> str | None:
        file = root / path
        return file.read_text() if file.is_file() else None

    return read


def at_commit(root: Path, commit: str) -> Reader:
    def read(path: str) -> str | None:
        done = subprocess.run(
            ["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, text=True
        )
        return done.stdout if done.returncode == 0 else None

    return read


@dataclass(frozen=True)
class Function:
    params: tuple[tuple[str, str, bool], ...]
    """(name, kind, has a default) of each parameter, in order."""

    def text(self) -> str:
        return "(" + ", ".join(f"{k}:{n}{'=' if d else ''}" for n, k, d in self.params) + ")"


@dataclass(frozen=True)
class Class:
    bases: tuple[str, ...]
    methods: tuple[tuple[str, Function], ...]
    attributes: tuple[tuple[str, str, bool], ...]
    """(name, annotation, has a default) of each annotated attribute."""
    record: bool = False
    """A dataclass or a Protocol: its annotated attributes are what callers pass or provide,
    so a new one without a default breaks them."""


@dataclass(frozen=True)
class Other:
    kind: str


Entry = Function | Class | Other


@dataclass
class Api:
    """A package's public names and what each is (None where its definition was not found)."""

    entries: dict[str, Entry | None] = field(default_factory=dict)


def package_api(read: Reader, src: str, module: str, modules: list[str] = ()) -> Api:
    """The public API of the package `module` whose sources are under `src` (a path from the
    repository root, e.g. `packages/titan-core/src`): its `__all__`, and `modules`' (dotted
    names: a subpackage with an `__all__` of its own, `titan_models.moe`, or a module whose
    every name without a leading underscore is public, the trainer's `titan_trainer.config`),
    named `module.name` there."""
    public = {name: where for name, where in _public(read, src, module).items()}
    entries = {name: definition(read, src, where, name) for name, where in public.items()}
    for sub in modules:
        names = _public(read, src, sub) or _module_names(read, src, sub)
        prefix = sub.removeprefix(module + ".")
        for name, where in names.items():
            entries[f"{prefix}.{name}"] = definition(read, src, where, name)
    return Api(entries)


def _module_names(read: Reader, src: str, module: str) -> dict[str, str]:
    """The names a module without an `__all__` defines at its top, but for `_private` ones."""
    text = _module_text(read, src, module)
    if text is None:
        return {}
    names = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = module
    return {name: where for name, where in names.items() if not name.startswith("_")}


def _public(read: Reader, src: str, module: str) -> dict[str, str | None]:
    """{public name: the module it comes from} of a package (its `__all__`, with the
    `__all__` of a subpackage it splices in as `*sub.__all__`)."""
    text = _module_text(read, src, module)
    if text is None:
        return {}
    names, where, spliced = _exports(ast.parse(text))
    public = {name: where.get(name, module) for name in names}  # else: defined right there
    for sub in spliced:
        public.update(_public(read, src, f"{module}.{sub}"))
    return public


def definition(read: Reader, src: str, module: str | None, name: str) -> Entry | None:
    """What `name` is in `module` (dotted), following the re-exports on the way: a package's
    `__init__.py` (whichever way it re-exports) and a module's own imports."""
    for _ in range(4):  # a name a module re-exports from another: follow it a little way
        if module is None:
            return None
        text = _module_text(read, src, module)
        if text is None:
            return None
        tree = ast.parse(text)
        found = _find(tree, name)
        if isinstance(found, Class):
            return _with_bases(read, src, module, tree, found)
        if found is None:
            found = _exports(tree)[1].get(name)  # a lazy package's table or TYPE_CHECKING block
            if found is None:
                submodule = _module_text(read, src, f"{module}.{name}")
                return Other("module") if submodule is not None else None
        if not isinstance(found, str):
            return found
        module = found
    return None


def used_names(root: Path, folders: list[str], package: str) -> set[tuple[str, str]]:
    """(module, name) pairs the Python files under `folders` (paths from `root`) take from
    `package`: `from titan_core import X`, `from titan_core.config import Y`, `titan_core.Z`."""
    used: set[tuple[str, str]] = set()
    files = [f for folder in folders for f in sorted((root / folder).rglob("*.py"))]
    for path in files:
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == package or node.module.startswith(package + "."):
                    used.update((node.module, a.name) for a in node.names if a.name != "*")
            elif isinstance(node, ast.Import):
                aliases.update(a.asname or a.name for a in node.names if a.name == package)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                used.add((package, node.attr))
    return used


def breaking_changes(old: Entry | None, new: Entry | None) -> list[str]:
    """Why a caller of `old` would fail with `new` (empty: compatible)."""
    if old is None:
        return []  # unknown before: nothing to compare
    if new is None:
        return ["removed"]
    if type(old) is not type(new):
        return [f"was {_kind(old)}, is {_kind(new)}"]
    if isinstance(old, Function):
        return _function_breaks(old, new)
    if isinstance(old, Class):
        why = [f"no longer derives from {b}" for b in old.bases if b not in new.bases]
        methods = dict(new.methods)
        for name, fn in old.methods:
            if name not in methods:
                why.append(f"method {name} removed")
            else:
                why += [f"method {name}: {w}" for w in _function_breaks(fn, methods[name])]
        attributes = {a: (t, d) for a, t, d in new.attributes}
        for name, annotation, had_default in old.attributes:
            if name not in attributes:
                why.append(f"attribute {name} removed")
            elif attributes[name][0] != annotation and not widens(annotation, attributes[name][0]):
                why.append(f"attribute {name}: {annotation} -> {attributes[name][0]}")
            elif had_default and not attributes[name][1]:
                why.append(f"attribute {name} lost its default")
        old_names = {a for a, _, _ in old.attributes}
        why += [
            f"new attribute {a} without a default"
            for a, _, d in new.attributes
            if a not in old_names and not d and new.record
        ]
        return why
    return [] if old == new else [f"{old.kind} -> {new.kind}"]


def _kind(entry: Entry) -> str:
    return f"a {entry.kind}" if isinstance(entry, Other) else f"a {type(entry).__name__.lower()}"


def widens(old: str, new: str) -> bool:
    """Whether the annotation `new` takes every value `old` took and nothing changes for what
    is read back: more `Literal` choices, or any string where some strings were allowed (a
    config key that takes more values)."""
    before, after = _literal(old), _literal(new)
    if before is None:
        return False
    if after is not None:
        return before <= after
    return new == "str" and all(isinstance(v, str) for v in before)


def _literal(annotation: str) -> set | None:
    try:
        node = ast.parse(annotation, mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Literal", "typing.Literal"):
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        try:
            return {ast.literal_eval(i) for i in items}
        except ValueError:
            return None
    return None


def _function_breaks(old: Function, new: Function) -> list[str]:
    why = []
    now = {n: (k, d) for n, k, d in new.params}
    for name, kind, had_default in old.params:
        if name in ("self", "cls"):
            continue
        if name not in now:
            why.append(f"parameter {name} removed")
        elif now[name][0] != kind:
            why.append(f"parameter {name}: {kind} -> {now[name][0]}")
        elif had_default and not now[name][1]:
            why.append(f"parameter {name} lost its default")
    old_names = {n for n, _, _ in old.params}
    why += [
        f"new parameter {n} without a default"
        for n, k, d in new.params
        if n not in old_names and not d and k not in ("*args", "**kwargs")
    ]
    positional = [n for n, k, _ in old.params if k in ("positional", "positional-only")]
    still = [
        n for n, k, _ in new.params if k in ("positional", "positional-only") and n in positional
    ]
    if still != [n for n in positional if n in still]:
        why.append("positional parameters reordered")
    return why


# ----------------------------------------------------------------------------- reading


def _exports(tree: ast.Module) -> tuple[list[str], dict[str, str], list[str]]:
    """(__all__, {name: module it comes from}, subpackages whose `__all__` it splices in) of
    an `__init__.py`."""
    names: list[str] = []
    spliced: list[str] = []
    where: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if a.name != "*":
                    where[a.asname or a.name] = node.module
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == "__all__":
                for e in node.value.elts:
                    if isinstance(e, ast.Starred) and isinstance(e.value, ast.Attribute):
                        spliced.append(ast.unparse(e.value.value))  # *llama3.__all__
                    else:
                        names.append(ast.literal_eval(e))
            elif isinstance(target, ast.Name) and target.id == "_EXPORTS":
                where.update(ast.literal_eval(node.value))
    return names, where, spliced


def _module_text(read: Reader, src: str, module: str) -> str | None:
    path = module.replace(".", "/")
    return read(f"{src}/{path}.py") or read(f"{src}/{path}/__init__.py")


def _find(tree: ast.Module, name: str) -> Entry | str | None:
    """`name`'s definition at the top of a module, or the module it imports it from."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return _function(node)
        if isinstance(node, ast.ClassDef) and node.name == name:
            return _class(node)
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return Other("value")
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if (a.asname or a.name) == name:
                    return node.module if a.name == name else Other(f"alias of {a.name}")
    return None


def _with_bases(read: Reader, src: str, module: str, tree: ast.Module, cls: Class) -> Class:
    """`cls` with the members it inherits from bases defined in this repository (a family's
    arguments that derive from the shared decoder's keep every field of it)."""
    methods, attributes = dict(cls.methods), {a: (t, d) for a, t, d in cls.attributes}
    bases = list(cls.bases)
    for base in cls.bases:
        found = _find(tree, base)
        if isinstance(found, str):  # imported into this module
            found = definition(read, src, found, base)
        if isinstance(found, Class):
            bases += [b for b in found.bases if b not in bases]
            for name, fn in found.methods:
                methods.setdefault(name, fn)
            for name, t, d in found.attributes:
                attributes.setdefault(name, (t, d))
    return Class(
        tuple(bases),
        tuple(sorted(methods.items())),
        tuple((a, t, d) for a, (t, d) in attributes.items()),
        cls.record,
    )


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Function:
    a = node.args
    params = []
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    for i, p in enumerate(positional):
        kind = "positional-only" if i < len(a.posonlyargs) else "positional"
        params.append((p.arg, kind, i >= first_default))
    if a.vararg:
        params.append((a.vararg.arg, "*args", True))
    for p, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append((p.arg, "keyword", default is not None))
    if a.kwarg:
        params.append((a.kwarg.arg, "**kwargs", True))
    return Function(tuple(params))


def _class(node: ast.ClassDef) -> Class:
    methods, attributes = [], []
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and (
            not item.name.startswith("_") or item.name in ("__init__", "__call__")
        ):
            methods.append((item.name, _function(item)))
        elif (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and not item.target.id.startswith("_")
        ):
            annotation = ast.unparse(item.annotation)
            attributes.append((item.target.id, annotation, item.value is not None))
    bases = tuple(ast.unparse(b) for b in node.bases)
    decorators = {ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in node.decorator_list}
    record = "dataclass" in decorators or any(b.split("[")[0].endswith("Protocol") for b in bases)
    return Class(bases, tuple(methods), tuple(attributes), record)
