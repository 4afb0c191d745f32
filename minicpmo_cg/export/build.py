"""``minicpmo-cg-patch export``: the lane's change set as a stack of pull requests.

Writes into ``OUT``, one folder per pull request of the stack (:mod:`.stack`):

- ``NN-key/`` for each vllm-omni PR, in merge order: ``NNNN-*.patch``, the ``git format-patch``
  series of that PR (it applies with ``git am`` on the pinned vllm-omni release once the PRs before
  it are applied: owned modules, one commit per vllm-omni patch, the PR's tests in vllm-omni's
  layout with their support modules vendored, the design page as far as this PR goes), every commit
  signed off, every new Python file with vllm-omni's SPDX header, all Python formatted and fixed by
  ruff with vllm-omni's settings; ``PR.md`` (the description in vllm-omni's template), ``PR-title.txt``
  and, when the PR needs edits to files the release wheel does not carry (Buildkite, docs
  navigation), ``UPSTREAM-EDITS.md``: which files of vllm-omni's git tree to edit and how, in plain
  words (``--checkout`` makes the same edits in a vllm-omni git checkout);
- ``vllm-key/`` for each vLLM PR: its series against the lane's pristine vLLM files (the change and
  its tests in vLLM's layout), ``PR.md`` and ``PR-title.txt``;
- ``STACK.md``: the stack in merge order with each PR's size and dependencies, opening with a
  warning when the identity of the commits is a placeholder (:mod:`.identity`);
- ``export.json``: the manifest (versions, base wheel, per PR its commits, files, tests, size, lint).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export import (
    docsplit,
    fetch,
    lint,
    prtext,
    pytestlog,
    stack,
    testmarks,
    transform,
    upstream_edits,
)
from minicpmo_cg.export import identity
from minicpmo_cg.export.changeset import RESULTS_PAGE, ChangeSet, owned_module, read_change_set
from minicpmo_cg.export.gitseries import Identity, SeriesRepo, wrap_body
from minicpmo_cg.lanes import all_lanes

__all__ = ["ExportOptions", "ExportResult", "PrResult", "export", "rewrite_prs"]

MANIFEST = "export.json"
STACK_FILE = "STACK.md"
#: the prefix of the branches ``--checkout`` makes (``PREFIX-NN-key``), which the texts name
DEFAULT_BRANCH = "minicpmo45-encoder-cuda-graphs"


@dataclass
class ExportOptions:
    """What ``export`` is asked for (see the CLI's help for each option)."""

    repo: Path
    out: Path
    author: Identity
    lane: str = "current"
    site_packages: Path | None = None
    #: a vLLM git checkout (of ``main``) each vLLM PR's series is checked against (:mod:`.vllm_main`)
    vllm_checkout: Path | None = None
    #: a vllm-omni git checkout (of ``main``) the stack is applied to, PR by PR (:mod:`.vllm_main`)
    omni_checkout: Path | None = None
    #: ``(KEY, N)`` of ``--pr-number``: PR KEY (a key or folder of the stack) is opened as number N
    pr_numbers: list[tuple[str, int]] = field(default_factory=list)
    #: the prefix of the branches ``--checkout`` makes, by which the texts name unopened PRs
    branch: str = DEFAULT_BRANCH


@dataclass
class PrResult:
    """One pull request as written: its folder, series, commits, files and text inputs."""

    key: str
    folder: str
    title: str
    series: list[Path]
    commits: list[dict]
    files: list[str]
    tests: list[str] = field(default_factory=list)
    vendored: dict[str, str] = field(default_factory=dict)
    lint: lint.LintReport = field(default_factory=lint.LintReport)
    size: dict = field(default_factory=dict)
    depends: list[str] = field(default_factory=list)
    vllm: list[str] = field(default_factory=list)
    page: str | None = None
    inputs: prtext.PrInputs | None = None
    messages: list[str] = field(default_factory=list)
    #: its number once opened (``--pr-number``) and the branch ``--checkout`` makes for it (None: a vLLM PR)
    number: int | None = None
    branch: str | None = None

    def manifest(self) -> dict:
        return {
            "key": self.key,
            "folder": self.folder,
            "title": self.title,
            "series": [f"{self.folder}/{p.name}" for p in self.series],
            "commits": self.commits,
            "files": self.files,
            "tests": self.tests,
            "vendored": self.vendored,
            "size": self.size,
            "depends": self.depends,
            "vllm": self.vllm,
            "page": self.page,
            "number": self.number,
            "branch": self.branch,
            "lint": {"problems": self.lint.problems, "notes": self.lint.notes},
        }


@dataclass
class ExportResult:
    """What ``export`` wrote and found."""

    out: Path
    prs: list[PrResult]
    vllm_prs: list[PrResult]
    warnings: list[str] = field(default_factory=list)
    #: The commits' identity is a placeholder (:func:`.identity.placeholder_problem`): why, and what to do.
    identity_problem: str | None = None

    @property
    def ok(self) -> bool:
        return all(pr.lint.ok for pr in self.prs)


def _prepare_out(out: Path) -> None:
    """Make ``out`` an empty export folder: new, or holding an earlier export (replaced).

    Raises:
        FileExistsError: ``out`` is a file, or a folder holding something else than an export.
    """
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory; pick a directory for the export")
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise FileExistsError(
            f"{out} is not empty and holds no earlier export ({MANIFEST}); pick another --out"
        )
    if out.is_dir():
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _docstring(text: str) -> str:
    import ast

    try:
        return ast.get_docstring(ast.parse(text)) or ""
    except SyntaxError:
        return ""


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


def _model_relative(rel: str) -> str:
    """An owned file as the model's folder names it (``encoder_cuda_graph/options.py``)."""
    path = PurePosixPath(rel)
    return path.relative_to(conv.MODEL_DIR).as_posix() if rel.startswith(conv.MODEL_DIR) else path.name


def _growth_verb(changes: list[tuple[str, str]]) -> str:
    """How a commit changes files an earlier PR added, from ``(before, after)`` texts, for its title.

    ``"extend"`` when it only adds lines, ``"trim"`` when it only removes lines, ``"change"`` otherwise.
    """
    added = removed = False
    for before, after in changes:
        for line in difflib.ndiff(before.splitlines(), after.splitlines()):
            added |= line.startswith("+ ")
            removed |= line.startswith("- ")
    if added and not removed:
        return "extend"
    return "trim" if removed and not added else "change"


def _title_topic(title: str) -> str:
    return title.split(": ", 1)[1] if title.startswith(conv.MODEL_TITLE + ": ") else title


class _StackBuilder:
    """Commits the stack PR by PR in one scratch repository on the release tree."""

    def __init__(self, cs: ChangeSet, st: stack.Stack, work: Path, opts: ExportOptions, ruff: Path):
        self.cs, self.stack, self.opts, self.ruff = cs, st, opts, ruff
        self.config = lint.ruff_config(work / "ruff.toml")
        self.wheel = fetch.wheel("vllm-omni", cs.lane.vllm_omni)
        tree = fetch.extract_package(self.wheel, "vllm_omni", work / "vllm-omni")
        self.omni_commit = fetch.release_commit(tree, "vllm_omni")
        self.repo = SeriesRepo(
            tree, opts.author, lambda root, files: lint.format_tree(ruff, self.config, root, files)
        )
        self.pages: dict[str, str] = {}  # page -> the text its last version has in the tree
        self.owned_exported: dict[
            str, str
        ] = {}  # owned file -> its last version in the tree (before formatting)
        self.tests_exported: dict[str, str] = {}  # test file -> its text as exported (before formatting)
        self.built: list[PrResult] = []  # the PRs built so far, in stack order
        self.multi_gpu_tests: set[str] = set()  # test files of the PRs so far marked multi_gpu
        self.known = set(cs.design_pages) | {
            p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file() and ".git" not in p.parts
        }

    def build(self, pr: stack.ResolvedPr) -> PrResult:
        start, first = self.repo.head(), len(self.repo.titles)
        modules = self._commit_owned(pr)
        for patch in pr.patches:
            self.repo.commit(
                stack.patch_commit_title(patch),
                wrap_body(patch.why),
                diff=patch.diff,
                format_paths=list(patch.file_paths),
            )
        tests, vendored = self._commit_tests(pr)
        pages = self._commit_docs(pr)
        out = self.opts.out / pr.folder
        series = self.repo.format_patch(out, since=start)
        files = sorted({f for changed in self.repo.files[first:] for f in changed})
        result = PrResult(
            key=pr.key,
            folder=pr.folder,
            title=pr.title,
            series=series,
            commits=[
                {"title": t, "files": f} for t, f in zip(self.repo.titles[first:], self.repo.files[first:])
            ],
            files=files,
            tests=tests,
            vendored=vendored,
            lint=lint.check_tree(self.ruff, self.config, self.repo.root, files),
            size={**self.repo.shortstat(start), "bytes": sum(p.stat().st_size for p in series)},
            page=next(
                (p for p in pr.pages if PurePosixPath(p).parent.as_posix() == conv.DESIGN_DOCS_DIR), None
            ),
            messages=self.repo.messages[first:],
        )
        result.inputs = prtext.PrInputs(
            key=pr.key,
            number=pr.number,
            title=pr.title,
            patches=list(pr.patches),
            modules=modules,
            remarks=list(pr.remarks),
            not_run=list(pr.spec.not_run),
            design=next(((p, pages[p]) for p in pr.pages if p == result.page), None),
            pages_added=[(p, pages[p]) for p in pr.pages if p != result.page],
            sections_added=[(page, heading) for page, heading in pr.sections if page not in pr.pages],
            commits=[c["title"] for c in result.commits],
            vllm_version=self.cs.lane.vllm,
            omni_version=self.cs.lane.vllm_omni,
            omni_commit=self.omni_commit,
            test_files=[f for f in tests if PurePosixPath(f).name.startswith("test_")],
            unit_marks=testmarks.levels_with_tests(
                prtext.UNIT_MARKS,
                [
                    path.read_text(encoding="utf-8")
                    for rel, path in pr.tests.items()
                    if PurePosixPath(rel).name.startswith("test_") and not rel.startswith("tests/e2e/")
                ],
            ),
            multi_gpu=any(
                "pytest.mark.multi_gpu" in path.read_text(encoding="utf-8") for path in pr.tests.values()
            ),
        )
        # the earlier PRs' test files this PR leaves as they are: its tree runs them too
        earlier = pytestlog.earlier_test_files(
            [{"tests": p.tests} for p in [*self.built, result]], len(self.built)
        )
        result.inputs.earlier_test_files = earlier
        result.inputs.earlier_marks = testmarks.levels_with_tests(
            prtext.UNIT_MARKS,
            [self.tests_exported[rel] for rel in earlier if not rel.startswith("tests/e2e/")],
        )
        # two-GPU tests among the earlier PRs' tests skip on this tree's one-GPU runs too (the mark is
        # the project's: the exported text no longer has it)
        self.multi_gpu_tests |= {
            rel
            for rel, path in pr.tests.items()
            if "pytest.mark.multi_gpu" in path.read_text(encoding="utf-8")
        }
        result.inputs.multi_gpu = result.inputs.multi_gpu or any(
            rel in self.multi_gpu_tests for rel in earlier
        )
        self.built.append(result)
        return result

    def _version(self, text: str, rel: str, upto: list[str]) -> str:
        """``text`` of ``rel`` as of the PR whose keys up to itself are ``upto`` (:mod:`.docsplit`)."""
        return docsplit.source_version(text, rel, upto, set(self.stack.keys))

    def _commit_owned(self, pr: stack.ResolvedPr) -> list[tuple[str, str]]:
        """Commit the PR's owned files, and the parts of earlier PRs' owned files tagged for it (an
        ``--hf-overrides`` key with the PR whose code reads it); return ``(module name, docstring)``
        of each new module (a package of owned files is one module, ``name/``, introduced by its
        ``__init__``; a module added to the package of an earlier PR is ``name/module.py``). The title
        says what the commit does: ``add X`` for new modules only, ``add X and extend Y for it``
        (``them``) when it also adds lines to modules an earlier PR added (``trim`` when it only
        removes lines from them, ``change`` when it does both)."""
        upto = self.stack.upto(pr.key)
        earlier = {
            rel: path
            for p in self.stack.omni
            if p.key in upto and p.key != pr.key
            for rel, path in p.owned.items()
        }
        files = {
            rel: transform.add_spdx(
                self._version(transform.drop_project_only(path.read_text(encoding="utf-8"), rel), rel, upto)
            )
            for rel, path in {**earlier, **pr.owned}.items()
        }
        grown = sorted(rel for rel in earlier if files[rel] != self.owned_exported.get(rel))
        previous = {rel: self.owned_exported.get(rel, "") for rel in grown}
        new = {rel: files[rel] for rel in pr.owned}
        changed = {**new, **{rel: files[rel] for rel in grown}}
        if not changed:
            return []
        self.owned_exported.update(changed)
        modules: dict[str, str] = {}
        for rel, text in new.items():
            module = owned_module(rel, self.cs.owned)
            if module != PurePosixPath(rel) and f"{module}/__init__.py" not in pr.owned:
                name = (
                    f"{module.name}/{PurePosixPath(rel).relative_to(module)}"  # into an earlier PR's package
                )
            else:
                name = module.name if module == PurePosixPath(rel) else f"{module.name}/"
            if module == PurePosixPath(rel) or rel == f"{module}/__init__.py" or not name.endswith("/"):
                modules[name] = _docstring(text)
            modules.setdefault(name, "")
        grown_names = ", ".join(_model_relative(rel) for rel in grown)
        verb = _growth_verb([(previous[rel], files[rel]) for rel in grown])
        if modules:
            names = ", ".join(modules)
            body = [para for name, doc in modules.items() for para in _module_overview(name, doc)]
            body = body or [f"New beside the MiniCPM-o 4.5 model file: {names}."]
            # a commit that also changes modules an earlier PR added says so: "add X" alone would hide it
            if grown:
                body.append(f"It also {verb}s {grown_names} for this change.")
            extend = f" and {verb} {grown_names} for {'it' if len(modules) == 1 else 'them'}" if grown else ""
            title = f"{conv.TITLE_PREFIX_MODEL} {conv.MODEL_TITLE}: add {names}{extend}"
        else:
            body = [f"{verb.capitalize()}s {grown_names} for this change."]
            title = f"{conv.TITLE_PREFIX_MODEL} {conv.MODEL_TITLE}: {grown_names} for {_title_topic(pr.spec.title)}"
        self.repo.commit(title, wrap_body("\n\n".join(body)), changed)
        return list(modules.items())

    def _commit_tests(self, pr: stack.ResolvedPr) -> tuple[list[str], dict[str, str]]:
        upto = self.stack.upto(pr.key)
        tests = {rel: path for p in self.stack.omni if p.key in upto for rel, path in p.tests.items()}
        vendored = transform.vendor_tests(
            self.cs.repo, tests, version=lambda text, rel: self._version(text, rel, upto)
        )
        # compared as exported, before ruff formats them: what an earlier PR committed is not repeated
        changed = {rel: text for rel, text in vendored.files.items() if self.tests_exported.get(rel) != text}
        if not changed:
            return [], {}
        self.tests_exported.update(changed)
        own = sorted(changed)
        body = ["Tests in vllm-omni's layout and markers (module level mark, cpu or cuda per test)."]
        helpers = sorted(t for t in own if t in vendored.vendored)
        if helpers:
            body.append("Helper modules beside them, shared by several tests:")
            for target in helpers:
                summary = prtext.first_paragraph(_docstring(vendored.files[target]))
                body.append(
                    f"{PurePosixPath(target).name}: {summary}" if summary else PurePosixPath(target).name
                )
        title = f"{conv.TITLE_PREFIX_TEST} {conv.MODEL_TITLE}: tests ({_title_topic(pr.spec.title)})"
        self.repo.commit(title, wrap_body("\n\n".join(body)), changed)
        return own, {t: vendored.vendored[t] for t in helpers}

    def _commit_docs(self, pr: stack.ResolvedPr) -> dict[str, str]:
        """Commit every page this PR adds or changes; return page -> its version as of this PR."""
        upto = self.stack.upto(pr.key)
        known_keys = set(self.stack.keys)
        versions = {}
        for page, path in self.cs.design_pages.items():
            if page not in pr.pages and page not in self.pages:
                continue
            text = transform.drop_project_only(path.read_text(encoding="utf-8"), page)
            text = docsplit.page_version(text, page, upto, known_keys, self.stack.page_sections.get(page))
            text = transform.strip_dead_links(text, page, self.known | self.pages.keys())
            versions[page] = text
        changed = {page: text for page, text in versions.items() if self.pages.get(page) != text}
        if changed:
            added = [page for page in changed if page not in self.pages]
            updated = [page for page in changed if page in self.pages]
            if any(PurePosixPath(page).parent.as_posix() == conv.DESIGN_DOCS_DIR for page in added):
                what = "encoder CUDA graph design pages"
            elif added:
                what = "design page " + ", ".join(
                    PurePosixPath(page).stem.replace("_", " ") for page in added
                )
            else:
                what = "design pages: the parts of this change"
            parts = []
            if added:
                parts.append("New design pages of the input encoder CUDA graphs: " + ", ".join(added) + ".")
            if updated:
                parts.append("The parts of this change in " + ", ".join(updated) + ".")
            body = " ".join(parts)
            self.repo.commit(f"{conv.TITLE_PREFIX_DOC} {conv.MODEL_TITLE}: {what}", wrap_body(body), changed)
            self.pages.update(changed)
        return versions


def _vllm_prs(cs: ChangeSet, st: stack.Stack, work: Path, opts: ExportOptions) -> list[PrResult]:
    if not st.vllm:
        return []
    from minicpmo_cg.export.vllm_base import pristine_files

    out = []
    for pr in st.vllm:
        base = work / f"vllm-{pr.key}"
        rels = sorted({rel for patch in pr.patches for rel in patch.file_paths})
        for rel, data in pristine_files(cs, rels, opts.site_packages).items():
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_bytes(data)
        repo = SeriesRepo(base, opts.author, formatter=lambda root, files: None)
        for patch in pr.patches:
            repo.commit(f"{pr.spec.prefixes[0]} {patch.subject}", wrap_body(patch.why), diff=patch.diff)
        if pr.tests:
            files = {
                target: transform.add_spdx(transform.drop_project_only(path.read_text(encoding="utf-8"), source),
                                           conv.VLLM_SPDX_LINES)
                for source, (target, path) in pr.tests.items()
            }  # fmt: skip
            body = "Tests of the change: " + ", ".join(files) + "."
            repo.commit(f"{conv.TITLE_PREFIX_TEST} {pr.spec.title} (tests)", wrap_body(body), files)
        series = repo.format_patch(opts.out / pr.folder)
        result = PrResult(
            key=pr.key,
            folder=pr.folder,
            title=pr.title,
            series=series,
            commits=[{"title": t, "files": f} for t, f in zip(repo.titles, repo.files)],
            files=sorted({f for changed in repo.files for f in changed}),
            tests=sorted(target for target, _ in pr.tests.values()),
            size={**repo.shortstat(repo.base), "bytes": sum(p.stat().st_size for p in series)},
        )
        result.inputs = prtext.PrInputs(
            key=pr.key,
            number=0,
            title=pr.title,
            patches=list(pr.patches),
            commits=[c["title"] for c in result.commits],
            vllm_version=cs.lane.vllm,
            omni_version=cs.lane.vllm_omni,
            test_files=[t for t in result.tests if PurePosixPath(t).name.startswith("test_")],
        )
        out.append(result)
    return out


def _check_against_main(vllm_prs: list[PrResult], checkout: Path | None) -> list[str]:
    """Check each vLLM PR's series against the vLLM checkout (``--vllm-checkout``), for its text;
    a warning per series that does not apply there."""
    if checkout is None:
        return []
    from minicpmo_cg.export import vllm_main

    warnings = []
    for pr in vllm_prs:
        pr.inputs.main_check = check = vllm_main.check_series(checkout, pr.series)
        if not check.applies:
            warnings.append(f"{pr.folder}: the series does not apply to {check.where}: {check.detail}")
    return warnings


def _check_stack_against_main(prs: list[PrResult], checkout: Path | None) -> list[str]:
    """Apply the vllm-omni PRs in order to the vllm-omni checkout (``--vllm-omni-checkout``), for their
    texts; a warning for the first series that does not apply there."""
    if checkout is None:
        return []
    from minicpmo_cg.export import vllm_main

    checks = vllm_main.check_stack(checkout, [pr.series for pr in prs])
    warnings = []
    for pr, check in zip(prs, checks):
        pr.inputs.main_check = check
        if not check.applies and not warnings:
            warnings.append(
                f"{pr.folder}: the series does not apply to {check.where} ({check.how}): {check.detail}"
            )
    return warnings


def _requirements() -> dict[str, list[str]]:
    """The installed vLLM's and vllm-omni's requirements (``Requires-Dist``, ``Requires-Python``)."""
    out = {}
    for dist in ("vllm", "vllm-omni"):
        try:
            meta = importlib.metadata.metadata(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        reqs = [r for r in (importlib.metadata.requires(dist) or []) if "extra ==" not in r]
        if meta.get("Requires-Python"):
            reqs.append(f"python{meta['Requires-Python']}")
        out[dist] = reqs
    return out


def export(opts: ExportOptions, table: tuple[stack.OmniPr, ...] = stack.STACK) -> ExportResult:
    """Export the lane's change set into ``opts.out`` as the stack of ``table`` (module docstring).

    Raises:
        FileExistsError: ``opts.out`` is a file, or a folder holding something else than an export.
        fetch.FetchError: the release wheel or ruff cannot be downloaded.
        transform.ExportError: a file cannot be exported as it is, or the stack table does not fit
            the checkout (:class:`.stack.StackError`; the message says why).
        RuntimeError: a patch does not apply to the release (git's message).
    """
    opts.out = opts.out.resolve()  # git writes the series from inside the scratch repository
    placeholder = identity.warn_if_placeholder(opts.author)  # before the minutes the export takes
    cs = read_change_set(opts.repo, opts.lane)
    if not cs.omni_patches:
        raise transform.ExportError(
            f"nothing to export for lane {cs.lane.name}: no vllm-omni patch is active there (all upstream or "
            f"not targeting vllm-omni {cs.lane.vllm_omni}), so the owned files are not installed either"
        )
    st = stack.resolve(cs, table)
    numbers = pr_numbers(opts.pr_numbers, st)  # a bad --pr-number fails before anything is written
    _prepare_out(opts.out)
    ruff = fetch.ruff_binary(conv.RUFF_VERSION)
    with tempfile.TemporaryDirectory(prefix="minicpmo-cg-export-") as tmp:
        work = Path(tmp)
        builder = _StackBuilder(cs, st, work, opts, ruff)
        prs = [builder.build(pr) for pr in st.omni]
        texts = {rel: (builder.repo.root / rel).read_text(encoding="utf-8") for pr in prs for rel in pr.files
                 if (builder.repo.root / rel).is_file()}  # fmt: skip
        vllm_prs = _vllm_prs(cs, st, work, opts)
        main_warnings = _check_against_main(vllm_prs, opts.vllm_checkout)
        main_warnings += _check_stack_against_main(prs, opts.omni_checkout)
        # a commit body is wrapped at 72 columns: checked with each paragraph on one line, so a word pair
        # the wrap splits is still found
        messages = {
            f"{pr.folder} commit {i}": re.sub(r"(?<!\n)\n(?!\n)", " ", m)
            for pr in prs
            for i, m in enumerate(pr.messages, 1)
        }
        wheel = builder.wheel
        omni_commit = builder.omni_commit
    result = ExportResult(out=opts.out, prs=prs, vllm_prs=vllm_prs, identity_problem=placeholder)
    result.warnings += [placeholder] if placeholder else []
    result.warnings += main_warnings
    _link(result, st, cs)
    _reference(result, numbers, opts.branch)
    _write_texts(cs, st, result)
    _write_manifest(cs, result, wheel, omni_commit)
    # the files as they end up, the commit messages, and every PR's series as written (each diff of each PR)
    _refuse_foreign_text(texts | messages | _series_messages(prs + vllm_prs), opts.out, result)
    return result


def pr_numbers(given: list[tuple[str, int]], st: stack.Stack) -> dict[str, int]:
    """``--pr-number KEY=N`` resolved: folder -> number. KEY is a PR's key or folder, vllm-omni's
    (``siglip-attention``, ``01-siglip-attention``) or vLLM's (``capture-error-mode``,
    ``vllm-capture-error-mode``).

    Raises:
        ValueError: a KEY names no PR of the stack, a PR is given two numbers, or two PRs of one
            repository the same number (each message names the option and the value).
    """
    folders = {pr.key: pr.folder for pr in st.omni} | {pr.folder: pr.folder for pr in st.omni}
    folders |= {pr.key: pr.folder for pr in st.vllm} | {pr.folder: pr.folder for pr in st.vllm}
    out: dict[str, int] = {}
    for key, number in given:
        folder = folders.get(key)
        if folder is None:
            known = ", ".join([pr.key for pr in st.omni] + [pr.key for pr in st.vllm])
            raise ValueError(
                f"--pr-number {key}={number}: no PR of the stack has the key {key!r} (keys: {known})"
            )
        if out.get(folder, number) != number:
            raise ValueError(f"--pr-number {key}={number}: {folder} is already given #{out[folder]}")
        out[folder] = number
    for repo, group in (("vllm-omni", st.omni), ("vllm", st.vllm)):
        taken: dict[int, str] = {}
        for pr in group:
            if pr.folder in out and out[pr.folder] in taken:
                raise ValueError(
                    f"--pr-number: {taken[out[pr.folder]]} and {pr.folder} are both given "
                    f"vllm-project/{repo}#{out[pr.folder]}"
                )
            taken.update({out[pr.folder]: pr.folder} if pr.folder in out else {})
    return out


def _reference(result: ExportResult, numbers: dict[str, int], branch: str) -> None:
    """Give every PR its number (when opened) and branch, and every text the references to them
    (:class:`.prtext.PrRef`); a warning while some are not numbered."""
    total = len(result.prs)
    refs = {}
    for k, pr in enumerate(result.prs, 1):
        pr.number, pr.branch = numbers.get(pr.folder), f"{branch}-{pr.folder}"
        refs[pr.folder] = prtext.PrRef(
            pr.title, pr.folder, prtext.OMNI_REPO, pr.number, (k, total), pr.branch
        )
    for pr in result.vllm_prs:
        pr.number = numbers.get(pr.folder)
        refs[pr.folder] = prtext.PrRef(pr.title, pr.folder, prtext.VLLM_REPO, pr.number)
    for pr in result.prs + result.vllm_prs:
        pr.inputs.refs = refs
    unnumbered = [pr.folder for pr in result.prs + result.vllm_prs if pr.number is None]
    if unnumbered and len(unnumbered) < len(refs):
        result.warnings.append(
            f"not numbered: {', '.join(unnumbered)}; the texts name them by title, place in the stack and branch: "
            "once opened, re-export with --pr-number KEY=N for each"
        )


def _series_messages(prs: list[PrResult]) -> dict[str, str]:
    return {f"{pr.folder}/{p.name}": p.read_text(encoding="utf-8") for pr in prs for p in pr.series}


def _link(result: ExportResult, st: stack.Stack, cs: ChangeSet) -> None:
    """Fill in each PR's dependencies, results and environment (stack order)."""
    vllm_by_key = {pr.key: pr for pr in result.vllm_prs}
    results = cs.results_page.read_text(encoding="utf-8") if cs.results_page else None
    requirements = _requirements()
    lanes = tuple(lane.name for lane in all_lanes(cs.repo / "lanes"))
    earlier: list[PrResult] = []
    for resolved, pr in zip(st.omni, result.prs):
        inp = pr.inputs
        pr.depends = [p.folder for p in earlier]
        pr.vllm = [vllm_by_key[k].folder for k in resolved.vllm]
        inp.earlier = [(p.title, p.folder) for p in earlier]
        inp.vllm_deps = [(vllm_by_key[k].title, vllm_by_key[k].folder) for k in resolved.vllm]
        via = [folder for p in earlier for folder in p.vllm if folder not in pr.vllm]
        by_folder = {v.folder: v for v in result.vllm_prs}
        inp.vllm_via = [(by_folder[f].title, f) for f in dict.fromkeys(via)]
        inp.total = len(result.prs)
        inp.results_headings = resolved.results
        inp.measured_upto = resolved.measured_upto
        if results is not None:
            own = transform.drop_project_only(results, RESULTS_PAGE)
            inp.results_text = docsplit.own_parts(own, RESULTS_PAGE, pr.key, set(st.keys))
        inp.requirements = requirements
        inp.lane, inp.lanes = cs.lane.name, lanes
        earlier.append(pr)
    for pr in result.prs:  # the vLLM PRs of the tree its figures were measured on
        tree = result.prs[: pr.inputs.measured_upto]
        folders = list(dict.fromkeys(folder for p in tree for folder in p.vllm))
        by_folder = {v.folder: v for v in result.vllm_prs}
        pr.inputs.measured_vllm = [(by_folder[f].title, f) for f in folders]
    for pr in result.vllm_prs:
        pr.inputs.needed_by = [(p.title, p.folder) for p in result.prs if pr.folder in p.vllm]
        pr.inputs.requirements = {d: r for d, r in requirements.items() if d == "vllm"}  # its own pins only


def _write_texts(cs: ChangeSet, st: stack.Stack, result: ExportResult) -> None:
    for pr in result.prs:
        pr.inputs.hand_commits = upstream_edits.hand_commits(pr.files, pr.page)
        (result.out / pr.folder / "PR.md").write_text(prtext.omni_pr(pr.inputs), encoding="utf-8")
        (result.out / pr.folder / "PR-title.txt").write_text(pr.title + "\n", encoding="utf-8")
        edits = upstream_edits.render(pr.files, pr.page, cs.lane.vllm_omni)
        if edits:
            (result.out / pr.folder / upstream_edits.EDITS_FILE).write_text(edits, encoding="utf-8")
        result.warnings += [f"{pr.folder}: {n}" for n in pr.inputs.notes]
    for pr in result.vllm_prs:
        (result.out / pr.folder / "PR.md").write_text(prtext.vllm_pr(pr.inputs), encoding="utf-8")
        (result.out / pr.folder / "PR-title.txt").write_text(pr.title + "\n", encoding="utf-8")
    (result.out / STACK_FILE).write_text(_stack_text(result), encoding="utf-8")


def _stack_text(result: ExportResult) -> str:
    """``STACK.md``: :func:`.prtext.stack_overview`, with the placeholder-identity note right under its
    title when the commits' identity is one."""
    text = prtext.stack_overview(result.prs, result.vllm_prs)
    if not result.identity_problem:
        return text
    note = identity.stack_note(result.identity_problem)
    title, sep, rest = text.partition("\n\n") if text.startswith("# ") else ("", "", text)
    return f"{title}{sep}{note}\n{rest}"


def _write_manifest(cs: ChangeSet, result: ExportResult, wheel: Path, omni_commit: str | None) -> None:
    manifest = {
        "lane": cs.lane.name,
        "vllm": cs.lane.vllm,
        "vllm_omni": cs.lane.vllm_omni,
        "base": {"wheel": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()},
        "omni_release_commit": omni_commit,
        "prs": [pr.manifest() for pr in result.prs],
        "vllm_prs": [pr.manifest() for pr in result.vllm_prs],
        "warnings": result.warnings,
    }
    (result.out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _refuse_foreign_text(exported: dict[str, str], out: Path, result: ExportResult) -> None:
    """Fail when an exported file, commit message or PR text names this project or what only it has.

    Raises:
        transform.ExportError: every such line, ``where:line: text`` (see
            :data:`conventions.PROJECT_WORDS` and :data:`conventions.NOT_UPSTREAM_WORDS`); reword it
            at its source, mark it project-only, or teach :mod:`.transform` the rewrite.
    """
    found = transform.project_mentions(exported)
    found += transform.project_mentions(exported, words=transform.NOT_UPSTREAM)
    for pr in result.prs + result.vllm_prs:
        texts = {f"{pr.folder}/{name}": (out / pr.folder / name).read_text(encoding="utf-8")
                 for name in ("PR.md", "PR-title.txt", upstream_edits.EDITS_FILE)
                 if (out / pr.folder / name).is_file()}  # fmt: skip
        for where, text in texts.items():
            found += transform.project_mentions({where: text})
            found += transform.project_mentions({where: text}, words=transform.NOT_UPSTREAM)
            found += transform.project_mentions({where: text}, words=transform.POSITIONAL)
    if found:
        raise transform.ExportError(
            f"the export names this project, or what only it has, in {len(found)} place(s); vllm-omni must see "
            "a self-contained change:\n  " + "\n  ".join(found)
        )


def rewrite_prs(result: ExportResult, runs: dict[str, list[prtext.PytestRun]]) -> None:
    """Write each PR's ``PR.md`` again with its test runs (folder -> runs) in its Test Result, and
    ``STACK.md`` with every PR's runs."""
    for pr in result.prs + result.vllm_prs:
        if pr.folder in runs:
            pr.inputs.runs = runs[pr.folder]
            render = prtext.omni_pr if pr in result.prs else prtext.vllm_pr
            (result.out / pr.folder / "PR.md").write_text(render(pr.inputs), encoding="utf-8")
    (result.out / STACK_FILE).write_text(_stack_text(result), encoding="utf-8")
