"""What the export reads from the checkout, at export time: nothing is copied into the repository.

- the lane's pins (``lanes/<lane>.txt``);
- the vllm-omni and vLLM patches active on that lane (``patches/*/series``: a patch whose
  ``Targets`` names the lane's version and whose ``Upstream-Since`` is not reached);
- the owned files (``vllm_omni/``: the adapter package and any module beside it);
- their tests: every ``tests/<dir>/`` mirroring the folder of an owned module (a package counts as
  one module, in the folder that holds it), and the end-to-end tests (``tests/e2e/``) named after
  an owned module;
- the design pages (``docs/design/**/*.md``: an overview and its topic pages) and the stack's
  results page (``docs/results/stack.md``: each PR measured on its own tree; the PR texts' Test
  Results come from it, while ``docs/results/README.md`` keeps the project's longer runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from minicpmo_cg import lanes, resources
from minicpmo_cg.patchtool.series import Patch, load_series

__all__ = ["ChangeSet", "active_patches", "owned_module", "read_change_set"]

#: The results page the PR texts take their GPU figures from.
RESULTS_PAGE = "docs/results/stack.md"
DESIGN_DIR = "docs/design"


@dataclass(frozen=True)
class ChangeSet:
    """The lane's change set, as found in the checkout ``repo``.

    Attributes:
        lane: the lane (pins).
        omni_patches / vllm_patches: the patches active on the lane, in series order.
        owned: site-relative path -> file, the files this project owns under ``vllm_omni/``.
        tests: repo-relative path -> file, the tests exported with them.
        design_pages: repo-relative path -> file (``docs/design/**/*.md``).
        results_page: the results page, or None when the checkout has none.
    """

    repo: Path
    lane: lanes.Lane
    omni_patches: tuple[Patch, ...]
    vllm_patches: tuple[Patch, ...]
    owned: dict[str, Path]
    tests: dict[str, Path]
    design_pages: dict[str, Path]
    results_page: Path | None


def _version_of(lane: lanes.Lane, package: str) -> str:
    return lane.vllm if package == "vllm" else lane.vllm_omni


def active_patches(folder: Path, lane: lanes.Lane) -> tuple[Patch, ...]:
    """The patches of ``folder``'s series that the lane needs: targeted and not yet upstream."""
    chosen = []
    for patch in load_series(folder):
        if not patch.targets_version(_version_of(lane, patch.package)):
            continue
        since = patch.upstream_since
        if since is not None and since.reached(_version_of(lane, since.package)):
            continue
        chosen.append(patch)
    return tuple(chosen)


def owned_module(rel: str, owned: dict[str, Path]) -> PurePosixPath:
    """The module the owned file ``rel`` belongs to: the outermost package of owned files holding
    it (a folder whose ``__init__.py`` is owned, e.g. the adapter package), else the file itself."""
    path = PurePosixPath(rel)
    for parent in reversed(path.parents):
        if (parent / "__init__.py").as_posix() in owned:
            return parent
    return path


def _tests_for(repo: Path, owned: dict[str, Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    modules = {owned_module(rel, owned) for rel in owned if rel.endswith(".py")}
    stems = {module.stem for module in modules}
    for module in sorted(modules):
        mirror = repo / "tests" / module.parent.relative_to("vllm_omni")
        for path in sorted(mirror.rglob("*.py")) if mirror.is_dir() else []:
            found[path.relative_to(repo).as_posix()] = path
    e2e = repo / "tests" / "e2e"
    for path in sorted(e2e.rglob("test_*.py")) if e2e.is_dir() else []:
        if any(stem in path.stem for stem in stems):
            found[path.relative_to(repo).as_posix()] = path
    return {rel: path for rel, path in sorted(found.items()) if "__pycache__" not in rel}


def read_change_set(repo: Path, lane_name: str) -> ChangeSet:
    """Read the change set of ``lane_name`` from the checkout ``repo``.

    Raises:
        FileNotFoundError: ``repo`` is no checkout of this project (no ``patches/`` or ``tests/``).
        minicpmo_cg.lanes.LaneError: unknown lane.
        minicpmo_cg.patchtool.series.PatchFormatError: a malformed patch.
    """
    for needed in ("patches", "tests", "lanes", "vllm_omni"):
        if not (repo / needed).is_dir():
            raise FileNotFoundError(f"{repo} is not a checkout of the patch set (no {needed}/); pass --repo")
    lane = lanes.get_lane(lane_name, repo / "lanes")
    owned = resources.owned_files(repo)
    pages = {p.relative_to(repo).as_posix(): p for p in sorted((repo / DESIGN_DIR).rglob("*.md"))}
    results = repo / RESULTS_PAGE
    return ChangeSet(
        repo=repo,
        lane=lane,
        omni_patches=active_patches(repo / "patches" / "vllm-omni", lane),
        vllm_patches=active_patches(repo / "patches" / "vllm", lane),
        owned=owned,
        tests=_tests_for(repo, owned),
        design_pages=pages,
        results_page=results if results.is_file() else None,
    )
