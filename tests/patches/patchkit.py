# SPDX-License-Identifier: Apache-2.0
"""Helpers of the patch tool tests: running the tool, temporary site-packages copies, hashes.

Every test that writes works on a temporary site-packages directory made of *copies*
(:func:`shutil.copy2`) of the lane's target files and the two ``*.dist-info`` directories,
never on the lane venv itself (whose files may be hard links shared with other venvs).

Only the command line (run as a process, or in-process through ``cli.run``) and
:mod:`minicpmo_cg.resources` are used here, so the tests built on these helpers judge any revision of
the tool by what it does to a site.
"""

from __future__ import annotations

import base64
import csv
import difflib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from minicpmo_cg import resources
from minicpmo_cg.patchtool import cli as tool_cli

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
ADAPTER_REL = resources.ADAPTER_RELPATH.as_posix()
#: the adapter package (a directory apply creates) and every owned file, site-relative
ADAPTER_PACKAGE_REL = resources.ADAPTER_PACKAGE_RELPATH.as_posix()
OWNED_RELS = tuple(resources.owned_files())
MODEL_REL = "vllm_omni/model_executor/models/minicpmo_4_5/minicpmo_4_5_omni_llm.py"
INIT_REL = "vllm_omni/model_executor/models/minicpmo_4_5/__init__.py"
WIRING = "vllm-omni/0004-minicpmo45-route-encoders-through-cuda-graphs.patch"
#: A line the wiring patch adds that no later patch of the series has in its context, and what
#: :func:`edit_wiring` makes of it: editing it gives 0004 a new revision that the series still applies over.
WIRING_LINE = "        encoder_graphs.validate_hf_overrides(config)  # every bad --hf-overrides key at once"
WIRING_LINE_EDITED = f"{WIRING_LINE}  # edited"
STATE_DIR = "minicpmo_cg_patch_state"
TMP_SUFFIX = ".minicpmo-cg-tmp"
GOOD_STATES = {"applied", "upstream", "n/a"}
#: the commands that act on an installation
COMMANDS = ("status", "check", "apply", "revert")
#: a bound on a subprocess that used to hang, so a regression fails instead of blocking the suite
HANG_GUARD_S = 120

#: pre-apply text of MODEL_REL and INIT_REL, filled by :func:`make_site`
SITE_SOURCE: dict[str, str] = {}


def cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.patchtool", *args],
        check=False,
        capture_output=kwargs.pop("capture_output", "stdout" not in kwargs),
        text=True,
        env=env,
        timeout=kwargs.pop("timeout", 300),
        **kwargs,
    )


def tool(capsys, *args: str) -> tuple[int, str]:
    """Run the command line in-process; (exit code, stdout + stderr)."""
    capsys.readouterr()
    code = tool_cli.run(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def sp(site: Path, *extra: str) -> list[str]:
    return ["--site-packages", str(site), *extra]


def refused(capsys, site: Path, *names: str, commands=COMMANDS, extra: tuple[str, ...] = ()) -> None:
    """Every command exits 2 naming each of ``names``, and the site stays byte-identical."""
    before = full_tree(site)
    for command in commands:
        code, text = tool(capsys, command, *sp(site, *extra))
        assert code == 2, f"{command}: {code}\n{text}"
        assert "Traceback" not in text
        for name in names:
            assert name in text, f"{command} does not name {name}:\n{text}"
    assert full_tree(site) == before


def edit_record(site: Path, edit) -> Path:
    """Apply ``edit`` to the parsed ``state.json`` of ``site`` and write it back; return its path."""
    path = site / STATE_DIR / "state.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record, indent=2))
    return path


def cli_json(*args: str) -> tuple[int, dict]:
    proc = cli(*args, "--json")
    return proc.returncode, json.loads(proc.stdout)


def sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


@functools.lru_cache(maxsize=1)
def _series_files() -> tuple[str, ...]:
    code, report = cli_json("status")
    assert code == 0, report
    rels: list[str] = []
    for patch in report["patches"]:
        rels += [rel for rel in patch["files"] if rel not in rels]
    return tuple(rels)


def target_rels() -> list[str]:
    """Every file of the shipped series (as the tool lists them) and every owned file (the adapter)."""
    return [*_series_files(), *OWNED_RELS]


def litter(root: Path) -> list[str]:
    """The tool's temporary files anywhere under ``root``."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(f"*{TMP_SUFFIX}"))


def hashes(site: Path, rels) -> dict[str, str | None]:
    return {rel: sha(site / rel) for rel in rels}


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (the whole temp site, state dir included)."""
    return {p.relative_to(root).as_posix(): sha(p) for p in sorted(root.rglob("*")) if p.is_file()}


def full_tree(root: Path) -> dict[str, str]:
    """:func:`tree` plus every directory and link (``dir``, ``-> target``): byte-identity of a site."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = f"-> {path.readlink()}"
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = sha(path)
    return out


def record_hashes(site: Path) -> dict[str, str]:
    """Wheel RECORD sha256 (hex) of every vllm / vllm-omni file."""
    out = {}
    for info in list(site.glob("vllm-*.dist-info")) + list(site.glob("vllm_omni-*.dist-info")):
        with open(info / "RECORD", newline="") as handle:
            for row in csv.reader(handle):
                if len(row) >= 2 and row[1].startswith("sha256="):
                    digest = base64.urlsafe_b64decode(row[1][len("sha256=") :] + "==")
                    out[row[0]] = digest.hex()
    return out


def set_version(site: Path, dist_glob: str, version: str) -> None:
    (info,) = site.glob(dist_glob)
    meta = info / "METADATA"
    lines = meta.read_text().splitlines(keepends=True)
    meta.write_text(
        "".join(f"Version: {version}\n" if line.startswith("Version:") else line for line in lines)
    )


def patch_text(rel: str, original: str, changed: str, *, targets: str, extra_header: str = "") -> str:
    diff = "".join(
        difflib.unified_diff(
            original.splitlines(keepends=True), changed.splitlines(keepends=True), f"a/{rel}", f"b/{rel}", n=3
        )
    )
    header = (
        "Subject: test patch\n"
        "Why: exercises the tool\n"
        "Origin: tests\n"
        "Upstream: none\n"
        f"Targets: {targets}\n"
        f"{extra_header}"
        "Drop-When: never\n"
        "---\n"
    )
    return header + diff


def make_patch(
    path: Path,
    rel: str,
    before: str,
    after: str,
    *,
    targets: str,
    extra_header: str = "",
    source: str | None = None,
) -> Path:
    """Write a one-file patch replacing the line ``before`` of ``source`` (default: pristine ``rel``)."""
    original = SITE_SOURCE[rel] if source is None else source
    lines = original.splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.rstrip("\n") == before)
    changed = "".join(lines[:index] + [after + "\n"] + lines[index + 1 :])
    path.write_text(patch_text(rel, original, changed, targets=targets, extra_header=extra_header))
    return path


def edit_wiring(patches: Path) -> None:
    """Edit :data:`WIRING_LINE` of the wiring patch in the series folder ``patches`` (in place)."""
    wiring = patches / WIRING
    text = wiring.read_text()
    edited = text.replace(f"+{WIRING_LINE}\n", f"+{WIRING_LINE_EDITED}\n", 1)
    assert edited != text, f"{WIRING} no longer adds {WIRING_LINE!r}"
    wiring.write_text(edited)


def make_site(tmp_path: Path, name: str = "site-packages") -> Path:
    """A site-packages copy: every target file (pre-apply), minicpmo_4_5/__init__.py, both dist-infos."""
    site = tmp_path / name
    site.mkdir()
    for pattern in ("vllm-*.dist-info", "vllm_omni-*.dist-info"):
        for info in SITE.glob(pattern):
            shutil.copytree(info, site / info.name)
    for rel in [*target_rels(), INIT_REL]:
        if rel not in OWNED_RELS and (SITE / rel).is_file():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(SITE / rel, site / rel)
    # The real installation may be applied; without its state the copy is "applied without a
    # record", which revert un-applies: the copy starts pristine either way.
    proc = cli("revert", "--site-packages", str(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (site / STATE_DIR).exists()
    SITE_SOURCE.clear()
    SITE_SOURCE.update({rel: (site / rel).read_text() for rel in (MODEL_REL, INIT_REL)})
    return site


class Sites:
    """A pristine and an applied copy of the lane's files, made once per test module; tests copy them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pristine = make_site(root, "pristine")
        self.applied = root / "applied"
        shutil.copytree(self.pristine, self.applied, symlinks=True)
        proc = cli("apply", "--site-packages", str(self.applied))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        self.count = 0

    def copy(self, which: str) -> Path:
        self.count += 1
        target = self.root / f"case-{self.count}"
        shutil.copytree(getattr(self, which), target, symlinks=True)
        return target


def custom_patches(tmp_path: Path, *extra: tuple[str, Path], folder: str = "vllm-omni") -> Path:
    """A copy of the shipped series with extra patches appended to ``folder``'s series."""
    root = tmp_path / "patches"
    if not root.exists():
        shutil.copytree(resources.patches_dir(), root)
    series = root / folder / "series"
    for name, source in extra:
        shutil.copy(source, root / folder / name)
        series.write_text(series.read_text() + f"{name}\n")
    return root


def unprivileged_prefix(probe_dir: Path) -> list[str] | None:
    """A command prefix that runs without the privilege to override file permissions, or None."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]
    locked = probe_dir / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        proc = subprocess.run([*prefix, "sh", "-c", f"touch {locked}/x"], capture_output=True, check=False)
        return prefix if proc.returncode != 0 else None
    finally:
        locked.chmod(0o755)
