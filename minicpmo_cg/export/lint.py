"""vllm-omni's lint on the exported files: ruff with its settings, and its own pre-commit checks.

:func:`ruff_config` writes vllm-omni's ``[tool.ruff]`` settings (:mod:`.conventions`) as a
``ruff.toml``; :func:`format_tree` applies ``ruff check --fix`` and ``ruff format`` with them (the
export's only formatting); :func:`check_tree` reports what is still wrong: ruff's findings and the
three local hooks re-expressed from their rules: ``check-spdx-header``, ``check-torch-cuda-call``
(``vllm_omni/`` files; hits in tests are returned separately, as the hook's file scope is not
known from a released artifact) and ``check-forbidden-imports`` (under ``vllm_omni/``).
"""

from __future__ import annotations

import ast
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from minicpmo_cg.export import conventions as conv

__all__ = ["LintReport", "check_tree", "format_tree", "ruff_config"]


def ruff_config(path: Path) -> Path:
    """Write vllm-omni's ruff settings to ``path`` (a ``ruff.toml``); return it."""

    def strings(items) -> str:
        return "[" + ", ".join(f'"{item}"' for item in items) + "]"

    lines = [f"line-length = {conv.RUFF_LINE_LENGTH}", "", "[lint]"]
    lines += [f"select = {strings(conv.RUFF_SELECT)}", f"ignore = {strings(conv.RUFF_IGNORE)}", ""]
    lines += ["[lint.per-file-ignores]"]
    lines += [f'"{glob}" = {strings(codes)}' for glob, codes in conv.RUFF_PER_FILE_IGNORES.items()]
    lines += ["", "[lint.flake8-tidy-imports.banned-api]"]
    lines += [f'"{name}".msg = "{msg}"' for name, msg in conv.RUFF_BANNED_API.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _ruff(ruff: Path, config: Path, root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ruff), *args, "--config", str(config), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )


def format_tree(ruff: Path, config: Path, root: Path, files: list[str]) -> None:
    """``ruff check --fix`` then ``ruff format`` on ``files`` (relative to ``root``), in place."""
    if files:
        _ruff(ruff, config, root, "check", "--fix", "--exit-zero", "--quiet", *files)
        _ruff(ruff, config, root, "format", "--quiet", *files)


@dataclass
class LintReport:
    """What vllm-omni's lint would reject (``problems``) and what may concern a reviewer (``notes``)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# a reference counts as a call (``real = torch.cuda.mem_get_info`` is flagged as the hook flags it)
_TORCH_CUDA = re.compile(r"\btorch\.cuda\.(?:" + "|".join(conv.TORCH_CUDA_BANNED) + r")\b")


def _torch_cuda_hits(rel: str, text: str) -> list[str]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        if _TORCH_CUDA.search(code):
            hits.append(f"{rel}:{n}: check-torch-cuda-call: {line.strip()[:100]}")
    return hits


def _forbidden_imports(rel: str, text: str) -> list[str]:
    hits = []
    for node in ast.walk(ast.parse(text, filename=rel)):
        names = []
        if isinstance(node, ast.Import):
            names = [(alias.name, alias.asname) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [(node.module, None)]
        for name, _ in names:
            top = name.split(".")[0]
            if top in conv.FORBIDDEN_IMPORTS:
                hits.append(
                    f"{rel}:{node.lineno}: check-forbidden-imports: {name}: {conv.FORBIDDEN_IMPORTS[top]}"
                )
    return hits


def _spdx(rel: str, text: str) -> list[str]:
    lines = [line for line in text.splitlines()[:3] if not line.startswith("#!")]
    if not text.strip() or tuple(lines[:2]) == conv.SPDX_LINES:
        return []
    return [f"{rel}:1: check-spdx-header: the file must start with {' / '.join(conv.SPDX_LINES)}"]


def check_tree(ruff: Path, config: Path, root: Path, files: list[str]) -> LintReport:
    """Every problem vllm-omni's lint finds in ``files`` (relative to ``root``), formatting included."""
    report = LintReport()
    py = [f for f in files if f.endswith(".py")]
    if py:
        check = _ruff(ruff, config, root, "check", "--output-format", "concise", *py)
        report.problems += [line for line in check.stdout.splitlines() if re.match(r"^\S+:\d+:\d+: ", line)]
        fmt = _ruff(ruff, config, root, "format", "--check", *py)
        report.problems += [line for line in fmt.stdout.splitlines() if line.startswith("Would reformat")]
        if check.returncode not in (0, 1) or fmt.returncode not in (0, 1):
            report.problems.append(f"ruff failed: {check.stderr.strip()} {fmt.stderr.strip()}".strip())
    for rel in py:
        text = (root / rel).read_text(encoding="utf-8")
        report.problems += _spdx(rel, text)
        if rel.startswith("vllm_omni/"):
            report.problems += _forbidden_imports(rel, text)
            if not rel.startswith(conv.TORCH_CUDA_ALLOWED_DIR):
                report.problems += _torch_cuda_hits(rel, text)
        else:
            report.notes += _torch_cuda_hits(rel, text)
    return report
