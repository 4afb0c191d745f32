"""What a PR's tree names and carries: nothing a later PR of the stack adds, no module without a user.

Each PR of the stack is reviewed, tested and merged on its own tree (the release with it and the PRs
before it applied), so that tree has to read as complete on its own:

- **no forward reference**: no file the stack has touched so far names, in code, a docstring, a
  comment or a design page, a file that a later PR adds (``fused_layers.py``, ``:mod:`.immediate```,
  ``test_x.py``, ``image_path.md``) or a name that only a later PR's code defines (a function, a class,
  an argument, an attribute its code sets, e.g. ``model._streaming_audio_encoder_graph``);
- **no module without a user**: every Python module a PR adds under ``vllm_omni/`` is imported by
  another file of its tree, code or test; a package's ``__init__`` re-exporting it counts only when
  some other file uses a name it re-exports. A module that only a later PR's code uses belongs to
  that PR;
- **no test a PR later**: a function or class a PR's code adds, which the tests name at all, is
  named by the code of the tests of that PR's tree (comments and docstrings do not count), not
  first by a later PR's: the tests of what a PR adds go up with it.

A name counts as a later PR's when the later PR's code under ``vllm_omni/`` defines it and the tree
does not have it: neither the release's nor the stack's code so far uses it (identifiers and the
words of string constants, docstrings left out), nor do the tests so far define it (a test setting
an attribute on the model defines nothing: the attribute is the model's). Only distinctive names
count (``snake_case`` with an inner underscore, or ``camelCase``), so an English word that a later
PR also uses as a name is never taken for it; and a later file's name counts only when no file of
the tree has the same name. In a file of the release that the stack changes, only the lines that
the release does not have are read.

:func:`problems` takes the release (:class:`ReleaseIndex`) and each PR's tree as the checks of
:mod:`.verify` leave it (:class:`Snapshot`, in stack order) and returns the findings per PR.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

__all__ = ["ReleaseIndex", "Snapshot", "forward_references", "late_tests", "problems", "unused_modules"]

#: The package whose Python modules must have a user in the tree that adds them.
CODE_ROOT = "vllm_omni/"
_WORD = re.compile(r"[A-Za-z_]\w*")


def distinctive(name: str) -> bool:
    """Whether ``name`` reads as code rather than as a word: an underscore inside it (``capture_now``,
    ``_streaming_audio_encoder_graph``) or a lower-case letter followed by a capital (``DuplexChunk``)."""
    core = name.strip("_")
    return "_" in core or re.search(r"[a-z][A-Z]", core) is not None


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except SyntaxError:  # the lint reports it
        return None


def _docstrings(tree: ast.Module) -> set[int]:
    """``id()`` of the docstring nodes of ``tree``'s module, classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    found.add(id(first.value))
    return found


def code_names(tree: ast.Module) -> set[str]:
    """What ``tree``'s code names: identifiers, attributes, arguments, keywords, definitions, imports
    and the words of its string constants (docstrings left out)."""
    docs = _docstrings(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.update(_WORD.findall(node.asname or node.name))
        elif isinstance(node, (ast.ImportFrom,)) and node.module:
            names.update(node.module.split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            names.update(_WORD.findall(node.value))
    return names


def defined_names(tree: ast.Module, *, attributes: bool, imports: bool) -> set[str]:
    """The names ``tree``'s code defines: functions, classes, arguments, assigned names, and with
    ``attributes`` the attributes it assigns (``model._x = ...``), with ``imports`` the names it imports."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif attributes and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif imports and isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    return names


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


@dataclass
class ReleaseIndex:
    """The release tree the stack applies to: its files, what its code names, and the text of each
    file the stack changes (to tell the stack's lines from the release's)."""

    paths: set[str]
    known: set[str]
    texts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, root: Path, touched: Iterable[str]) -> ReleaseIndex:
        """The release at ``root``; ``touched``: every file the stack adds or changes."""
        paths = {
            p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts
        }
        known: set[str] = set()
        for rel in sorted(paths):
            if rel.endswith(".py") and (text := _read_text(root / rel)) is not None:
                if (tree := _parse(text)) is not None:
                    known |= code_names(tree)
        texts = {
            rel: text for rel in touched if rel in paths and (text := _read_text(root / rel)) is not None
        }
        return cls(paths=paths, known=known, texts=texts)


@dataclass
class Snapshot:
    """One PR's tree: every file the stack has added or changed so far that the tree has, by path."""

    folder: str
    files: dict[str, str]

    @classmethod
    def read(cls, root: Path, folder: str, touched: Iterable[str]) -> Snapshot:
        return cls(
            folder,
            {rel: text for rel in sorted(set(touched)) if (text := _read_text(root / rel)) is not None},
        )


def _file_patterns(rel: str, taken: set[str]) -> list[re.Pattern[str]]:
    """How a text names the file ``rel``: its name (``fused_layers.py``), for a Python module also its
    dotted or relative module name (``encoder_cuda_graph.immediate``, ``:mod:`.immediate```,
    ``from .ops``) and, when distinctive, its bare name (``startup_capture``). ``taken``: the file and
    module names the tree has already, which name those instead."""
    path = PurePosixPath(rel)
    module = path.parent if path.name == "__init__.py" else path.with_suffix("")
    stem, parent = module.name, module.parent.name
    patterns = []
    if path.name != "__init__.py" and path.name not in taken:
        patterns.append(rf"(?<![\w.-]){re.escape(path.name)}(?!\w)")
    if path.suffix == ".py" and stem not in taken:
        patterns.append(rf"(?<![\w.]){re.escape(parent)}[./]{re.escape(stem)}(?![\w])")
        patterns.append(rf"(?:\bfrom\s+|`~?)\.{re.escape(stem)}(?![\w])")
        if distinctive(stem):
            patterns.append(rf"(?<![\w.]){re.escape(stem)}(?![\w])")
    return [re.compile(p) for p in patterns]


def _new_lines(text: str, release: str | None) -> list[tuple[int, str]]:
    """``(line number, line)`` of ``text``, without the lines the release's version of the file has."""
    have = set(release.splitlines()) if release is not None else set()
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line not in have]


def _knowledge(release: ReleaseIndex, snap: Snapshot) -> tuple[set[str], set[str]]:
    """``(known, defined)`` of one tree: the names it has (its code's, its tests' definitions) and the
    distinctive names its code under ``vllm_omni/`` defines (attributes included)."""
    known = set(release.known)
    defined: set[str] = set()
    for rel, text in snap.files.items():
        if not rel.endswith(".py") or (tree := _parse(text)) is None:
            continue
        if rel.startswith(CODE_ROOT):
            known |= code_names(tree)
            defined |= {n for n in defined_names(tree, attributes=True, imports=False) if distinctive(n)}
        else:
            known |= defined_names(tree, attributes=False, imports=True)
    return known, defined


def forward_references(release: ReleaseIndex, snapshots: list[Snapshot]) -> dict[str, list[str]]:
    """Per PR (folder), each line of its tree that names a file or a name a later PR adds."""
    first_file: dict[str, int] = {}
    for i, snap in enumerate(snapshots):
        for rel in snap.files:
            if rel not in release.paths:
                first_file.setdefault(rel, i)
    knowledge = [_knowledge(release, snap) for snap in snapshots]
    found: dict[str, list[str]] = {snap.folder: [] for snap in snapshots}
    for k, snap in enumerate(snapshots):
        known = knowledge[k][0]
        later_names: dict[str, int] = {}
        for j in range(len(snapshots) - 1, k, -1):
            later_names.update(dict.fromkeys(knowledge[j][1] - known, j))
        have = release.paths | set(snap.files)
        taken = {PurePosixPath(p).name for p in have} | {
            (PurePosixPath(p).parent if p.endswith("/__init__.py") else PurePosixPath(p).with_suffix("")).name
            for p in have
            if p.endswith(".py")
        }
        later_files = {
            rel: (j, _file_patterns(rel, taken))
            for rel, j in first_file.items()
            if j > k and rel not in snap.files
        }
        for rel, text in sorted(snap.files.items()):
            for n, line in _new_lines(text, release.texts.get(rel)):
                named = {
                    f"{name} ({snapshots[later_names[name]].folder})"
                    for name in set(_WORD.findall(line)) & later_names.keys()
                }
                named |= {
                    f"{other} ({snapshots[j].folder})"
                    for other, (j, patterns) in later_files.items()
                    if any(p.search(line) for p in patterns)
                }
                if named:
                    found[snap.folder].append(
                        f"{rel}:{n}: names {', '.join(sorted(named))}, which a later PR adds: {line.strip()[:100]}"
                    )
    return found


def _module_name(rel: str) -> str:
    path = PurePosixPath(rel)
    module = path.parent if path.name == "__init__.py" else path.with_suffix("")
    return ".".join(module.parts)


def _imports(tree: ast.Module, rel: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import of ``tree`` (``rel``: its path, for relative imports), of
    ``pytest.importorskip("m")`` and of a string constant that is a ``vllm_omni`` module path."""
    out = []
    package = list(PurePosixPath(rel).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names if alias.name != "*"]
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            out.append((module, names))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"vllm_omni(?:\.\w+)+", node.value):
                out.append((node.value, []))
    return out


def _used(rel: str, trees: dict[str, ast.Module]) -> bool:
    """Whether a file of ``trees`` other than ``rel`` (and its package's re-export) imports the module
    ``rel``, or uses a name that its package's ``__init__`` re-exports from it."""
    module = _module_name(rel)
    is_package = rel.endswith("/__init__.py")
    package_init = f"{PurePosixPath(rel).parent}/__init__.py"
    reexported: set[str] = set()
    for other, tree in trees.items():
        if other == rel:
            continue
        for target, names in _imports(tree, other):
            hits = [target, *(f"{target}.{name}" for name in names)]
            if not any(h == module or h.startswith(module + ".") for h in hits):
                continue
            if other == package_init and not is_package:
                reexported |= set(names) if target == module else set()
                continue
            return True
    if not reexported:
        return False
    for other, tree in trees.items():
        if other in (rel, package_init):
            continue
        for node in ast.walk(tree):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else node.name
                if isinstance(node, ast.alias)
                else None
            )
            if name in reexported:
                return True
    return False


def unused_modules(release: ReleaseIndex, snapshots: list[Snapshot]) -> dict[str, list[str]]:
    """Per PR (folder), each Python module under ``vllm_omni/`` it adds that no other file of its tree
    imports (:func:`_used`)."""
    found: dict[str, list[str]] = {snap.folder: [] for snap in snapshots}
    before: set[str] = set(release.paths)
    for snap in snapshots:
        trees = {
            rel: tree for rel, text in snap.files.items() if rel.endswith(".py") and (tree := _parse(text))
        }
        for rel in sorted(snap.files.keys() - before):
            if rel.startswith(CODE_ROOT) and rel in trees and not _used(rel, trees):
                found[snap.folder].append(
                    f"{rel}: added here, and no other file of this tree imports it or uses what its package "
                    "re-exports from it (code or tests): it belongs to the first PR whose code uses it"
                )
        before |= set(snap.files)
    return found


def _code_definitions(snap: Snapshot) -> set[str]:
    """The distinctive names of the functions and classes (methods included) of a tree's code."""
    names: set[str] = set()
    for rel, text in snap.files.items():
        if rel.startswith(CODE_ROOT) and rel.endswith(".py") and (tree := _parse(text)) is not None:
            names |= {
                node.name
                for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and distinctive(node.name)
            }
    return names


def _tested_names(snap: Snapshot) -> set[str]:
    """What the code of a tree's tests and their helpers names (:func:`code_names`), but what they
    define themselves."""
    names: set[str] = set()
    for rel, text in snap.files.items():
        if not rel.startswith(CODE_ROOT) and rel.endswith(".py") and (tree := _parse(text)) is not None:
            names |= code_names(tree) - defined_names(tree, attributes=False, imports=False)
    return names


def late_tests(release: ReleaseIndex, snapshots: list[Snapshot]) -> dict[str, list[str]]:
    """Per PR (folder), each function or class its code adds that no test of its tree names and a
    later PR's tests name first."""
    defined = [_code_definitions(snap) for snap in snapshots]
    tested = [_tested_names(snap) for snap in snapshots]
    found: dict[str, list[str]] = {snap.folder: [] for snap in snapshots}
    for k, snap in enumerate(snapshots):
        added = defined[k] - (defined[k - 1] if k else set()) - release.known
        for name in sorted(added - tested[k]):
            later = next((j for j in range(k + 1, len(snapshots)) if name in tested[j]), None)
            if later is not None:
                found[snap.folder].append(
                    f"{name}: added here, and first named by the tests of {snapshots[later].folder}: the tests "
                    "of what a PR adds go with it"
                )
    return found


def problems(release: ReleaseIndex, snapshots: list[Snapshot]) -> dict[str, list[str]]:
    """Per PR (folder, in stack order): :func:`forward_references`, :func:`unused_modules` and
    :func:`late_tests`."""
    refs = forward_references(release, snapshots)
    unused = unused_modules(release, snapshots)
    late = late_tests(release, snapshots)
    return {snap.folder: refs[snap.folder] + unused[snap.folder] + late[snap.folder] for snap in snapshots}
