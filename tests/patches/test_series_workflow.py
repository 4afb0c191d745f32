# SPDX-License-Identifier: Apache-2.0
"""Series semantics on synthetic patches: stacking, ``base``, conflict causes, ambiguity, lanes.

The synthetic target files live in a temporary site-packages copy (never in RECORD), and
each test uses its own patch root holding only its synthetic series.
"""

from __future__ import annotations

import json
from pathlib import Path

import patchkit
import pytest
from patchkit import cli, patch_text, set_version

from minicpmo_cg import lanes
from minicpmo_cg.patchtool.gnupatch import GnuPatch
from minicpmo_cg.patchtool.series import parse_patch

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

OMNI_FILE = "vllm_omni/_cg_synthetic_stack.py"
VLLM_FILE = "vllm/_cg_synthetic_both_lanes.py"
PRISTINE = "".join(f"line_{i:02d} = {i}\n" for i in range(1, 31))


def series_root(tmp_path: Path, folder: str, patches: dict[str, str]) -> Path:
    """A patch root whose ``folder`` series lists ``patches`` (name -> text) in order."""
    root = tmp_path / "series"
    (root / folder).mkdir(parents=True, exist_ok=True)
    for name, text in patches.items():
        (root / folder / name).write_text(text)
    (root / folder / "series").write_text("".join(f"{name}\n" for name in patches))
    return root


def change(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


def omni_targets(versions: dict[str, str]) -> str:
    return f"vllm-omni=={versions['vllm-omni']}"


def state(site: Path, root: Path) -> tuple[int, dict]:
    proc = cli("check", "--site-packages", str(site), "--patches-dir", str(root), "--json")
    report = json.loads(proc.stdout)
    return proc.returncode, {p["name"].split("/", 1)[1]: p for p in report["patches"]}


# ---------------------------------------------------------------------------------------------
# stacked patches to one file: base, stale starting point, earlier patch changed, wrong version
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def stacked(tmp_site, tmp_path, versions):
    """A site with the synthetic file and a series of one patch P1 changing line 10."""
    (tmp_site / OMNI_FILE).write_text(PRISTINE)
    after_p1 = change(PRISTINE, "line_10 = 10\n", "line_10 = 10  # P1\n")
    p1 = patch_text(OMNI_FILE, PRISTINE, after_p1, targets=omni_targets(versions))
    return tmp_site, tmp_path, versions, p1, after_p1


def test_base_writes_the_file_with_the_earlier_patches_applied(stacked):
    site, tmp_path, versions, p1, after_p1 = stacked
    root = series_root(tmp_path, "vllm-omni", {"0001-p1.patch": p1})
    out = tmp_path / "work"
    proc = cli("base", OMNI_FILE, "--site-packages", str(site), "--patches-dir", str(root), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "a" / OMNI_FILE).read_text() == (out / "b" / OMNI_FILE).read_text() == after_p1
    said = " ".join(proc.stdout.split())
    assert "0001-p1.patch" in said and "diff -u a/<path> b/<path>" in said

    # A patch made from that starting point stacks on P1 and applies; revert takes both back.
    p2 = patch_text(
        OMNI_FILE,
        after_p1,
        change(after_p1, "line_12 = 12\n", "line_12 = 12  # P2\n"),
        targets=omni_targets(versions),
    )
    root = series_root(tmp_path, "vllm-omni", {"0001-p1.patch": p1, "0002-p2.patch": p2})
    assert cli("apply", "--site-packages", str(site), "--patches-dir", str(root)).returncode == 0
    text = (site / OMNI_FILE).read_text()
    assert "# P1" in text and "# P2" in text
    assert cli("revert", "--site-packages", str(site), "--patches-dir", str(root)).returncode == 0
    assert (site / OMNI_FILE).read_text() == PRISTINE

    # Refreshing P2: --before gives P1's result again, even while the series is applied.
    assert cli("apply", "--site-packages", str(site), "--patches-dir", str(root)).returncode == 0
    out2 = tmp_path / "refresh"
    proc = cli(
        "base",
        "--before",
        "0002-p2.patch",
        "--site-packages",
        str(site),
        "--patches-dir",
        str(root),
        "--out",
        str(out2),
    )
    assert proc.returncode == 0, proc.stderr
    assert (out2 / "a" / OMNI_FILE).read_text() == after_p1
    proc = cli(
        "base",
        "--before",
        "0001-p1.patch",
        "--site-packages",
        str(site),
        "--patches-dir",
        str(root),
        "--out",
        str(tmp_path / "first"),
    )
    assert (tmp_path / "first" / "a" / OMNI_FILE).read_text() == PRISTINE


def test_base_refuses_to_overwrite_edits_and_unknown_patches(stacked):
    site, tmp_path, _, p1, _ = stacked
    root = series_root(tmp_path, "vllm-omni", {"0001-p1.patch": p1})
    out = tmp_path / "work"
    (out / "b" / OMNI_FILE).parent.mkdir(parents=True)
    (out / "b" / OMNI_FILE).write_text("my edit\n")
    proc = cli("base", OMNI_FILE, "--site-packages", str(site), "--patches-dir", str(root), "--out", str(out))
    assert proc.returncode == 2 and "exists with other content" in proc.stderr
    assert (out / "b" / OMNI_FILE).read_text() == "my edit\n"
    proc = cli(
        "base", "--before", "0009-none.patch", "--site-packages", str(site), "--patches-dir", str(root)
    )
    assert (
        proc.returncode == 2
        and "is not in the series" in proc.stderr
        and "vllm-omni/0001-p1.patch" in proc.stderr
    )


def test_a_patch_diffed_from_the_pristine_file_is_a_stale_starting_point(stacked):
    site, tmp_path, versions, p1, _ = stacked
    # P2 made from the pristine file, with P1's line in its context: not where the series has it.
    p2 = patch_text(
        OMNI_FILE,
        PRISTINE,
        change(PRISTINE, "line_12 = 12\n", "line_12 = 12  # P2\n"),
        targets=omni_targets(versions),
    )
    root = series_root(tmp_path, "vllm-omni", {"0001-p1.patch": p1, "0002-p2.patch": p2})
    before = patchkit.tree(site)
    code, states = state(site, root)
    assert code == 1
    detail = states["0002-p2.patch"]["detail"]
    assert "stale starting point" in detail and "vllm-omni/0001-p1.patch" in detail
    assert "minicpmo-cg-patch base --before vllm-omni/0002-p2.patch" in detail
    assert f"does not apply to vllm-omni {versions['vllm-omni']}" not in detail  # not blamed on the version
    assert cli("apply", "--site-packages", str(site), "--patches-dir", str(root)).returncode == 1
    assert patchkit.tree(site) == before


def test_an_earlier_patch_that_changed_is_named(stacked):
    site, tmp_path, versions, _, after_p1 = stacked
    # P2 builds on P1's added line (it changes the line right below it, with P1's line as context) ...
    p2 = patch_text(
        OMNI_FILE,
        after_p1,
        change(after_p1, "line_11 = 11\n", "line_11 = 11  # P2\n"),
        targets=omni_targets(versions),
    )
    # ... and then P1 is edited.
    p1_new = patch_text(
        OMNI_FILE,
        PRISTINE,
        change(PRISTINE, "line_10 = 10\n", "line_10 = 10  # P1, revised\n"),
        targets=omni_targets(versions),
    )
    root = series_root(tmp_path, "vllm-omni", {"0001-p1.patch": p1_new, "0002-p2.patch": p2})
    code, states = state(site, root)
    assert code == 1 and states["0001-p1.patch"]["state"] == "pending"
    detail = states["0002-p2.patch"]["detail"]
    assert "an earlier patch changed" in detail and "vllm-omni/0001-p1.patch" in detail
    assert "stale starting point" not in detail


def test_a_patch_for_another_version_is_blamed_on_the_version(stacked):
    site, tmp_path, versions, p1, _ = stacked
    other = PRISTINE.replace("line_20 = 20\n", "line_20 = 2000\n")
    p2 = patch_text(
        OMNI_FILE,
        other,
        change(other, "line_21 = 21\n", "line_21 = 21  # P2\n"),
        targets=omni_targets(versions),
    )
    root = series_root(tmp_path, "vllm-omni", {"0001-p1.patch": p1, "0002-p2.patch": p2})
    code, states = state(site, root)
    detail = states["0002-p2.patch"]["detail"]
    assert code == 1 and f"does not apply to vllm-omni {versions['vllm-omni']}" in detail
    assert "refresh the patch for this version" in detail and "FAILED" in detail
    assert "stale" not in detail and "earlier patch changed" not in detail


# ---------------------------------------------------------------------------------------------
# a hunk whose context matches at more than one place
# ---------------------------------------------------------------------------------------------

BLOCK = "".join(f"    step_{i} = compute({i})\n" for i in range(8))
AMBIGUOUS = "def first():\n" + BLOCK + "\n\ndef second():\n" + BLOCK + "\n\ndef third():\n    pass\n"


def test_a_hunk_that_matches_at_two_places_is_refused(tmp_site, tmp_path, versions):
    (tmp_site / OMNI_FILE).write_text(AMBIGUOUS)
    # Meant for second(); its 7 old-side lines also occur, identically, in first().
    lines = AMBIGUOUS.splitlines(keepends=True)
    target = len(lines) - 1 - lines[::-1].index("    step_4 = compute(4)\n")
    edited = "".join(lines[:target] + ["    step_4 = compute(40)\n"] + lines[target + 1 :])
    text = patch_text(OMNI_FILE, AMBIGUOUS, edited, targets=omni_targets(versions))
    root = series_root(tmp_path, "vllm-omni", {"0001-ambiguous.patch": text})
    patch = parse_patch(root / "vllm-omni" / "0001-ambiguous.patch", "vllm-omni")
    # In a version with 12 more lines on top, the line in the hunk header points into first():
    # GNU patch alone applies the hunk there, with exit 0.
    shifted = "# a comment line\n" * 12 + AMBIGUOUS
    run = GnuPatch().run(patch.diff, {OMNI_FILE: shifted.encode()})
    assert run.ok
    landed = run.contents[OMNI_FILE].decode()
    assert landed.index("compute(40)") < landed.index("def second")  # the wrong function
    (tmp_site / OMNI_FILE).write_text(shifted)
    before = patchkit.tree(tmp_site)
    code, states = state(tmp_site, root)
    detail = states["0001-ambiguous.patch"]["detail"]
    assert code == 1 and states["0001-ambiguous.patch"]["state"] == "conflict"
    assert "ambiguous" in detail and "matches at 2 places" in detail and OMNI_FILE in detail
    assert cli("apply", "--site-packages", str(tmp_site), "--patches-dir", str(root)).returncode == 1
    assert patchkit.tree(tmp_site) == before


def test_unique_context_is_accepted(tmp_site, tmp_path, versions):
    (tmp_site / OMNI_FILE).write_text(AMBIGUOUS)
    edited = AMBIGUOUS.replace("def third():\n    pass\n", "def third():\n    return 3\n")
    text = patch_text(OMNI_FILE, AMBIGUOUS, edited, targets=omni_targets(versions))
    root = series_root(tmp_path, "vllm-omni", {"0001-unique.patch": text})
    assert cli("apply", "--site-packages", str(tmp_site), "--patches-dir", str(root)).returncode == 0
    assert (tmp_site / OMNI_FILE).read_text() == edited


# ---------------------------------------------------------------------------------------------
# a vLLM patch for both lanes after legacy-only ones
# ---------------------------------------------------------------------------------------------


def test_a_patch_for_both_lanes_applies_after_legacy_only_patches_on_every_lane(tmp_site, tmp_path):
    """Series: 0001 legacy-only (upstream since the current vLLM), 0002 both lanes, 0003 another version."""
    legacy, current = lanes.get_lane("legacy"), lanes.get_lane("current")
    upstream = change(PRISTINE, "line_05 = 5\n", "line_05 = 5  # capture axes\n")
    p1 = patch_text(
        VLLM_FILE,
        PRISTINE,
        upstream,
        targets=f"vllm=={legacy.vllm}",
        extra_header=f"Upstream-Since: vllm=={current.vllm}\nUpstream-Probe: ^line_05 = 5  # capture axes$\n",
    )
    both = change(upstream, "line_07 = 7\n", "line_07 = 7  # both lanes\n")
    p2 = patch_text(VLLM_FILE, upstream, both, targets=f"vllm=={legacy.vllm}, vllm=={current.vllm}")
    p3 = patch_text(VLLM_FILE, both, change(both, "line_20 = 20\n", "line_20 = 0\n"), targets="vllm==0.1.0")
    root = series_root(
        tmp_path, "vllm", {"0001-legacy-only.patch": p1, "0002-both-lanes.patch": p2, "0003-other.patch": p3}
    )
    for lane in lanes.all_lanes():
        set_version(tmp_site, "vllm-*.dist-info", lane.vllm)
        set_version(tmp_site, "vllm_omni-*.dist-info", lane.vllm_omni)
        shipped = PRISTINE if lane.name == "legacy" else upstream  # the current vLLM ships 0001
        (tmp_site / VLLM_FILE).write_text(shipped)
        code, states = state(tmp_site, root)
        assert code == 0, (lane.name, states)
        expected = {"legacy": "pending", "current": "upstream"}[lane.name]
        assert states["0001-legacy-only.patch"]["state"] == expected, lane.name
        assert states["0002-both-lanes.patch"]["state"] == "pending"
        assert states["0003-other.patch"]["state"] == "n/a"
        assert cli("apply", "--site-packages", str(tmp_site), "--patches-dir", str(root)).returncode == 0
        assert (tmp_site / VLLM_FILE).read_text() == both, lane.name
        assert cli("revert", "--site-packages", str(tmp_site), "--patches-dir", str(root)).returncode == 0
        assert (tmp_site / VLLM_FILE).read_text() == shipped, lane.name
