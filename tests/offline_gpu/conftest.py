"""Fixtures of the offline GPU runner tests: hand-made lane bundles and a stand-in host Python."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from minicpmo_cg.offline_gpu import payload
from minicpmo_cg.offline_gpu.cli import REPO

#: Stands in for the host's python3 in the run tests: the runner's own steps see real behaviour,
#: the parts are faked. ``-m minicpmo_cg.bench --hang`` starts a grandchild and sleeps (timeouts).
FAKE_PYTHON = """#!{python}
import subprocess, sys, time
from pathlib import Path
args = sys.argv[1:]
module = args[1] if args[:1] == ["-m"] else None
if module == "pytest":
    print("3 passed")
    sys.exit(0)
if module == "minicpmo_cg.demo":
    print("demo broke")
    sys.exit(1)
if module == "minicpmo_cg.bench":
    out = Path(args[args.index("--json") + 1])
    if "--hang" in args:
        child = subprocess.Popen(["sleep", "120"])
        (out.parent / "grandchild.pid").write_text(str(child.pid))
        time.sleep(120)
    print("noise")
    print("=== RESULTS: fake")
    print("row 1")
    out.write_text("{{}}")
    sys.exit(0)
if module in ("minicpmo_cg.offline_gpu.probe", "minicpmo_cg.patchtool"):
    Path("{calls}").open("a").write(" ".join(args) + "\\n")
    print("fake " + " ".join(args))
    sys.exit(0)
print("unexpected: " + " ".join(args), file=sys.stderr)
sys.exit(9)
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An executable that answers like the host's python3 for the runner's commands.

    Calls of the probe and the patch tool are appended to ``fake_python.with_suffix(".calls")``.
    """
    path = tmp_path / "fakepython"
    path.write_text(FAKE_PYTHON.format(python=sys.executable, calls=path.with_suffix(".calls")))
    path.chmod(0o755)
    return path


MakeBundle = Callable[..., Path]


@pytest.fixture
def make_bundle() -> MakeBundle:
    """``make_bundle(root, lane="current", fingerprint=None, patched=True, deps=None, files=None)``.

    Writes ``root/<lane>/site.tar.xz`` (``files``: relative path -> text; default one package
    ``fakepkg``) and a manifest; ``fingerprint`` defaults to this checkout's payload (fresh),
    ``deps`` to the lane's dependency list.
    """

    def make(root: Path, lane: str = "current", fingerprint: str | None = None, patched: bool = True,
             deps: list[str] | None = None, files: dict[str, str] | None = None) -> Path:  # fmt: skip
        site = root / f"stage-{lane}"
        for rel, text in (files or {"fakepkg/__init__.py": "WHERE = 'bundle'\n"}).items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(text)
        lane_dir = root / lane
        lane_dir.mkdir(parents=True, exist_ok=True)
        payload.pack(site, lane_dir / payload.ARCHIVE, preset=1)
        manifest = {
            "lane": lane,
            "vllm": "0.30.0",
            "vllm_omni": "0.30.0",
            "patched": patched,
            "payload_fingerprint": fingerprint or payload.payload_fingerprint(REPO),
            "archive_sha256": payload.file_sha256(lane_dir / payload.ARCHIVE),
            "deps": payload.read_deps(lane) if deps is None else deps,
        }
        payload.write_manifest(lane_dir, manifest)
        return lane_dir

    return make
