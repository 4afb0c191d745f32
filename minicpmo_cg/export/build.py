"""``minicpmo-cg-patch export``: the lane's change set as a pull request against vllm-omni.

Writes into ``OUT``:

- ``vllm-omni/NNNN-*.patch``: the ``git format-patch`` series against the pinned vllm-omni release
  (the adapter and the modules beside it; one commit per active vllm-omni patch; the tests in
  vllm-omni's layout with their support modules vendored; the design page), every commit signed
  off, every new Python file with vllm-omni's SPDX header, all Python formatted and fixed by ruff
  with vllm-omni's settings;
- ``vllm/NNNN-*.patch``: the vLLM changes the lane still needs (a separate series: they belong to
  vllm-project/vllm) and ``vllm-PR-N.md`` for each;
- ``PR.md`` and ``PR-title.txt``: the vllm-omni pull request;
- ``UPSTREAM-EDITS.md``: the edits to files the release wheel does not carry (Buildkite step, docs
  navigation), applied by ``--checkout`` to a vllm-omni git checkout instead;
- ``export.json``: the manifest (versions, commits and files, vendored modules, warnings, lint).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import fetch, lint, prtext, transform, upstream_edits
from minicpmo_cg.export.changeset import ChangeSet, owned_module, read_change_set
from minicpmo_cg.export.gitseries import Identity, SeriesRepo, wrap_body
from minicpmo_cg.lanes import all_lanes

__all__ = ["ExportOptions", "ExportResult", "export", "rewrite_pr"]

MANIFEST = "export.json"


@dataclass
class ExportOptions:
    """What ``export`` is asked for (see the CLI's help for each option)."""

    repo: Path
    out: Path
    author: Identity
    lane: str = "current"
    site_packages: Path | None = None
    cpu_result: str | None = None


@dataclass
class ExportResult:
    """What ``export`` wrote and found."""

    out: Path
    title: str
    omni_series: list[Path]
    vllm_series: list[Path]
    commits: list[dict]
    files: list[str]
    vendored: dict[str, str]
    lint: lint.LintReport
    warnings: list[str] = field(default_factory=list)
    pr_inputs: prtext.PrInputs | None = None


def _prepare_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise FileExistsError(
            f"{out} is not empty and holds no earlier export ({MANIFEST}); pick another --out"
        )
    for name in ("vllm-omni", "vllm"):
        shutil.rmtree(out / name, ignore_errors=True)
    for stale in out.glob("vllm-PR-*.md"):
        stale.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _commit_owned(repo: SeriesRepo, cs: ChangeSet) -> None:
    files = {
        rel: transform.add_spdx(transform.drop_project_only(path.read_text(encoding="utf-8"), rel))
        for rel, path in cs.owned.items()
    }
    # a package of owned files is one new module: named once (``name/``), introduced by its __init__
    shown: dict[str, None] = {}
    body = []
    for rel, text in files.items():
        module = owned_module(rel, cs.owned)
        name = module.name if module == PurePosixPath(rel) else f"{module.name}/"
        shown[name] = None
        if module == PurePosixPath(rel) or rel == f"{module}/__init__.py":
            body += _module_overview(name, _docstring(text))
    names = ", ".join(shown)
    body = body or [f"New beside the MiniCPM-o 4.5 model file: {names}."]
    repo.commit(
        f"{conv.TITLE_PREFIX_MODEL} {conv.MODEL_TITLE}: add {names}", wrap_body("\n\n".join(body)), files
    )


def _module_overview(name: str, doc: str, paragraphs: int = 2) -> list[str]:
    """A commit body's paragraphs on a new module: its docstring's summary, then its first
    ``paragraphs`` prose paragraphs (a list or a paragraph introducing one ends the overview)."""
    blocks = [b.strip() for b in re.split(r"\n\s*\n", doc.strip()) if b.strip()]
    if not blocks:
        return []
    out = [f"{name}, new beside the MiniCPM-o 4.5 model file: {blocks[0]}"]
    for block in blocks[1 : 1 + paragraphs]:
        if block.startswith(("-", "*", "::")) or block.rstrip().endswith(":"):
            break
        out.append(block)
    return out


def _docstring(text: str) -> str:
    import ast

    try:
        return ast.get_docstring(ast.parse(text)) or ""
    except SyntaxError:
        return ""


def _commit_patches(repo: SeriesRepo, cs: ChangeSet) -> None:
    for patch in cs.omni_patches:
        subject = (
            patch.subject.split(": ", 1)[1] if patch.subject.startswith("minicpmo_4_5: ") else patch.subject
        )
        title = f"{conv.TITLE_PREFIX_MODEL} {conv.MODEL_TITLE}: {subject}"
        repo.commit(title, wrap_body(patch.why), diff=patch.diff, format_paths=list(patch.file_paths))


def _commit_tests(repo: SeriesRepo, cs: ChangeSet) -> transform.Vendored:
    vendored = transform.vendor_tests(cs.repo, cs.tests)
    body = ["Tests in vllm-omni's layout and markers (module level mark, cpu or cuda per test)."]
    if vendored.vendored:
        body.append("Helper modules beside them, shared by several tests:")
        for target in sorted(vendored.vendored):
            summary = prtext.first_paragraph(_docstring(vendored.files[target]))
            body.append(f"{Path(target).name}: {summary}" if summary else Path(target).name)
    title = f"{conv.TITLE_PREFIX_TEST} {conv.MODEL_TITLE}: tests of the input encoder CUDA graphs"
    repo.commit(title, wrap_body("\n\n".join(body)), vendored.files)
    return vendored


def _commit_docs(repo: SeriesRepo, cs: ChangeSet, known: set[str]) -> None:
    files = {
        rel: transform.strip_dead_links(
            transform.drop_project_only(path.read_text(encoding="utf-8"), rel), rel, known
        )
        for rel, path in cs.design_pages.items()
    }
    body = "The design page of the input encoder CUDA graphs: " + ", ".join(files) + "."
    repo.commit(
        f"{conv.TITLE_PREFIX_DOC} {conv.MODEL_TITLE}: encoder CUDA graph design page", wrap_body(body), files
    )


def _tree_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}


def _vllm_series(cs: ChangeSet, work: Path, opts: ExportOptions) -> tuple[list[Path], list[str], list[str]]:
    if not cs.vllm_patches:
        return [], [], []
    from minicpmo_cg.export.vllm_base import pristine_files

    base = work / "vllm"
    rels = sorted({rel for patch in cs.vllm_patches for rel in patch.file_paths})
    for rel, data in pristine_files(cs, rels, opts.site_packages).items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(data)
    repo = SeriesRepo(base, opts.author, formatter=lambda root, files: None)
    for patch in cs.vllm_patches:
        repo.commit(prtext.vllm_pr(patch, cs.lane.vllm, "")[0], wrap_body(patch.why), diff=patch.diff)
    series = repo.format_patch(opts.out / "vllm")
    return series, repo.titles, repo.messages


def _build_omni(cs: ChangeSet, work: Path, opts: ExportOptions, ruff: Path) -> tuple[SeriesRepo, dict]:
    config = lint.ruff_config(work / "ruff.toml")
    wheel = fetch.wheel("vllm-omni", cs.lane.vllm_omni)
    tree = fetch.extract_package(wheel, "vllm_omni", work / "vllm-omni")
    base_files = _tree_files(tree)
    repo = SeriesRepo(tree, opts.author, lambda root, files: lint.format_tree(ruff, config, root, files))
    _commit_owned(repo, cs)
    _commit_patches(repo, cs)
    vendored = _commit_tests(repo, cs)
    known = base_files | {f for files in repo.files for f in files} | set(cs.design_pages)
    _commit_docs(repo, cs, known)
    info = {
        "config": config,
        "wheel": wheel,
        "omni_commit": fetch.release_commit(tree, "vllm_omni"),
        "vendored": vendored.vendored,
    }
    return repo, info


def export(opts: ExportOptions) -> ExportResult:
    """Export the lane's change set into ``opts.out`` (see the module docstring for the files).

    Raises:
        FileExistsError: ``opts.out`` holds something else than an earlier export.
        fetch.FetchError: the release wheel or ruff cannot be downloaded.
        transform.ExportError: a file cannot be exported as it is (the message says why).
        RuntimeError: a patch does not apply to the release (git's message).
    """
    opts.out = opts.out.resolve()  # git writes the series from inside the scratch repository
    cs = read_change_set(opts.repo, opts.lane)
    if not cs.omni_patches:
        raise transform.ExportError(
            f"nothing to export for lane {cs.lane.name}: no vllm-omni patch is active there (all upstream or "
            f"not targeting vllm-omni {cs.lane.vllm_omni}), so the owned files are not installed either"
        )
    _prepare_out(opts.out)
    ruff = fetch.ruff_binary(conv.RUFF_VERSION)
    with tempfile.TemporaryDirectory(prefix="minicpmo-cg-export-") as tmp:
        work = Path(tmp)
        repo, info = _build_omni(cs, work, opts, ruff)
        files = sorted({f for changed in repo.files for f in changed})
        report = lint.check_tree(ruff, info["config"], repo.root, files)
        omni_series = repo.format_patch(opts.out / "vllm-omni")
        vllm_series, vllm_titles, vllm_messages = _vllm_series(cs, work, opts)
        texts = {rel: (repo.root / rel).read_text(encoding="utf-8") for rel in files}
    messages = {f"vllm-omni commit {i}": m for i, m in enumerate(repo.messages, 1)}
    messages |= {f"vllm commit {i}": m for i, m in enumerate(vllm_messages, 1)}
    result = ExportResult(
        out=opts.out,
        title=prtext.title(cs.design_pages[next(iter(cs.design_pages))].read_text(encoding="utf-8")),
        omni_series=omni_series,
        vllm_series=vllm_series,
        commits=[{"title": t, "files": f} for t, f in zip(repo.titles, repo.files)],
        files=files,
        vendored=info["vendored"],
        lint=report,
    )
    _write_texts(cs, opts, result, info, vllm_titles)
    _refuse_project_mentions(texts | messages, opts.out)
    return result


def _refuse_project_mentions(exported: dict[str, str], out: Path) -> None:
    """Fail when an exported file, commit message or pull request text names this project.

    Raises:
        transform.ExportError: every such line, ``where:line: text`` (see
            :data:`conventions.PROJECT_WORDS`); reword it at its source, mark it project-only, or
            teach :mod:`.transform` the rewrite.
    """
    found = transform.project_mentions(exported)
    pr_texts = {
        p.name: p.read_text(encoding="utf-8") for p in [out / "PR.md", *sorted(out.glob("vllm-PR-*.md"))]
    }
    pr_texts["PR-title.txt"] = (out / "PR-title.txt").read_text(encoding="utf-8")
    found += transform.project_mentions({"PR.md": pr_texts.pop("PR.md")}, conv.PR_SOURCE_NOTE_PREFIX)
    found += transform.project_mentions(pr_texts)
    if found:
        raise transform.ExportError(
            f"the export names this project in {len(found)} place(s); vllm-omni must see a self-contained "
            "change:\n  " + "\n  ".join(found)
        )


def _test_commands(files: list[str]) -> list[str]:
    units = sorted(
        {str(Path(f).parent) for f in files if f.startswith("tests/") and not f.startswith("tests/e2e/")}
    )
    e2e = sorted(f for f in files if f.startswith("tests/e2e/") and Path(f).name.startswith("test_"))
    out = []
    for folder in units:
        out += [
            f'pytest -sv {folder} -m "core_model and cpu"',
            f'pytest -sv {folder} -m "core_model and cuda"',
        ]
    out += [
        f"pytest -sv {f}  # serving, eager vs graphed: needs the checkpoint and an 80 GB GPU" for f in e2e
    ]
    return out


def _write_texts(
    cs: ChangeSet, opts: ExportOptions, result: ExportResult, info: dict, vllm_titles: list[str]
) -> None:
    design_rel, design_path = next(iter(cs.design_pages.items()))
    inputs = prtext.PrInputs(
        design_text=design_path.read_text(encoding="utf-8"),
        design_path=design_rel,
        results_text=cs.results_page.read_text(encoding="utf-8") if cs.results_page else None,
        vllm_version=cs.lane.vllm,
        omni_version=cs.lane.vllm_omni,
        omni_commit=info["omni_commit"],
        commits=[c["title"] for c in result.commits],
        vllm_patches=list(cs.vllm_patches),
        vllm_series=[f"vllm/{p.name}" for p in result.vllm_series],
        test_commands=_test_commands(result.files),
        cpu_result=opts.cpu_result,
        lane=cs.lane.name,
        lanes=tuple(lane.name for lane in all_lanes(cs.repo / "lanes")),
    )
    result.pr_inputs = inputs
    (opts.out / "PR.md").write_text(prtext.omni_pr(inputs), encoding="utf-8")
    (opts.out / "PR-title.txt").write_text(result.title + "\n", encoding="utf-8")
    for i, (patch, path) in enumerate(zip(cs.vllm_patches, result.vllm_series), 1):
        title, body = prtext.vllm_pr(patch, cs.lane.vllm, f"vllm/{path.name}")
        (opts.out / f"vllm-PR-{i}.md").write_text(f"<!-- title: {title} -->\n\n{body}", encoding="utf-8")
    edits = upstream_edits.render(result.files, design_rel)
    (opts.out / "UPSTREAM-EDITS.md").write_text(edits, encoding="utf-8")
    result.warnings += inputs.notes
    manifest = {
        "lane": cs.lane.name,
        "vllm": cs.lane.vllm,
        "vllm_omni": cs.lane.vllm_omni,
        "base": {
            "wheel": info["wheel"].name,
            "sha256": hashlib.sha256(info["wheel"].read_bytes()).hexdigest(),
        },
        "omni_release_commit": info["omni_commit"],
        "title": result.title,
        "commits": result.commits,
        "vllm_commits": vllm_titles,
        "series": [f"vllm-omni/{p.name}" for p in result.omni_series]
        + [f"vllm/{p.name}" for p in result.vllm_series],
        "files": result.files,
        "vendored": result.vendored,
        "lint": {"problems": result.lint.problems, "notes": result.lint.notes},
        "warnings": result.warnings,
    }
    (opts.out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def rewrite_pr(out: Path, result: ExportResult, cpu_result: str) -> None:
    """Write ``PR.md`` again with the exported CPU tests' pytest summary in its Test Result."""
    if result.pr_inputs is None:
        raise ValueError("the export wrote no PR text")
    result.pr_inputs.cpu_result = cpu_result
    (out / "PR.md").write_text(prtext.omni_pr(result.pr_inputs), encoding="utf-8")
