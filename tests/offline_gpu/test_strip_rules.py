"""CPU checks of the bundle's strip rules: what of the upstream wheels is carried, what is dropped."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from minicpmo_cg.offline_gpu import strip

pytestmark = pytest.mark.core_model

ELF = b"\x7fELF\x02\x01\x01\x00"


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("name", "head", "keep"),
    [
        ("vllm/config/model.py", b"", True),
        ("vllm/_C_stable_libtorch.abi3.so", ELF, True),  # stable C ABI: loads under the host's torch
        ("vllm/_moe_C_stable_libtorch.abi3.so", b"", False),
        ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", b"", False),
        ("vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so", b"", False),
        ("foo/libbar.so.1.2", b"", False),
        ("vllm/vllm-rs", ELF, False),  # a 55 MB executable without an extension
        ("vllm/utils/numa_wrapper.sh", b"", True),
        ("vllm/third_party/x/include/cutlass.hpp", b"", False),
        ("vllm/third_party/fmha_sm100/csrc/fmha_sm100_plan.cu", b"", False),
        ("vllm/entrypoints/serve/instrumentator/static/swagger-ui-bundle.js", b"", False),
        ("vllm/distributed/kv_transfer/disagg_prefill_workflow.jpg", b"", False),
        ("vllm/distributed/kv_transfer/README.md", b"", False),
        ("vllm/model_executor/layers/fused_moe/configs/README", b"", False),
        # runtime data stays: kernel tuning configs, chat templates, the type marker
        ("vllm/model_executor/layers/fused_moe/configs/E=8,N=14336,device_name=NVIDIA_H200.json", b"", True),
        ("vllm/transformers_utils/chat_templates/template_basic.jinja", b"", True),
        ("vllm/py.typed", b"", True),
        # vllm-omni's media are model assets and real inputs of the demo
        ("vllm_omni/model_executor/models/step_audio2/assets/default_female.wav", b"RIFF", True),
        ("vllm_omni/model_executor/models/covo_audio/speaker_prompt/prompt_latent.npy", b"", True),
        ("vllm_omni/some/figure.png", b"", True),
        # dist-info: version metadata kept (importlib.metadata, the patch tool's lane check), RECORD dropped
        ("vllm-0.30.0.dist-info/METADATA", b"", True),
        ("vllm-0.30.0.dist-info/entry_points.txt", b"", True),
        ("vllm-0.30.0.dist-info/licenses/LICENSE", b"", True),
        ("vllm-0.30.0.dist-info/RECORD", b"", False),
        ("vllm/__pycache__/envs.cpython-312.pyc", b"", False),
        ("vllm/config/", b"", False),
    ],
)
def test_classify(name: str, head: bytes, keep: bool) -> None:
    kept, rule = strip.classify(name, head)
    assert kept is keep, rule
    assert (rule == strip.KEEP) is keep


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.mark.cpu
def test_extract_wheel_applies_the_rules_and_counts(tmp_path: Path) -> None:
    whl = _wheel(
        tmp_path / "demo-1.0-py3-none-any.whl",
        {
            "demo/__init__.py": b"X = 1\n",
            "demo/_native.abi3.so": ELF + b"\0" * 100,
            "demo/tool": ELF + b"\0" * 10,
            "demo/script": b"#!/bin/sh\necho hi\n",
            "demo/include/a.h": b"int a;",
            "demo/data/config.json": b"{}",
            "demo-1.0.dist-info/METADATA": b"Name: demo\nVersion: 1.0\n",
            "demo-1.0.dist-info/RECORD": b"",
        },
    )
    site = tmp_path / "site"
    site.mkdir()
    stats = strip.extract_wheel(whl, site)
    kept = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert kept == ["demo-1.0.dist-info/METADATA", "demo/__init__.py", "demo/data/config.json", "demo/script"]
    assert stats["kept_files"] == 4 and stats["kept_bytes"] == len(b"X = 1\n{}#!/bin/sh\necho hi\n") + 24
    assert stats["dropped"]["native executable"] == [1, 18]
    assert stats["dropped"]["native extension (not carried)"] == [1, 108]


@pytest.mark.cpu
def test_extract_wheel_refuses_members_outside_the_site(tmp_path: Path) -> None:
    whl = _wheel(tmp_path / "evil-1.0-py3-none-any.whl", {"../escape.py": b""})
    (tmp_path / "site").mkdir()
    with pytest.raises(ValueError, match="escapes"):
        strip.extract_wheel(whl, tmp_path / "site")
    assert not (tmp_path / "escape.py").exists()


@pytest.mark.cpu
def test_strip_site_keeps_test_packages_of_dependencies(tmp_path: Path) -> None:
    # xgrammar imports its own `testing` subpackage at import time: it must survive.
    site = tmp_path / "site"
    for rel in (
        "xgrammar/testing.py",
        "xgrammar/tvm_ffi_binding/testing/__init__.py",
        "pkg/tests/__init__.py",
        "pkg/__pycache__/m.cpython-312.pyc",
        "pkg/include/x.h",
        "pkg-1.0.dist-info/RECORD",
        "pkg-1.0.dist-info/METADATA",
        "bin/pkg-cli",
        "vllm/__pycache__/keep.pyc",
    ):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("x")
    removed = strip.strip_site(site)
    left = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert "xgrammar/tvm_ffi_binding/testing/__init__.py" in left and "pkg/tests/__init__.py" in left
    assert "pkg-1.0.dist-info/METADATA" in left
    for gone in (
        "pkg/__pycache__/m.cpython-312.pyc",
        "pkg/include/x.h",
        "pkg-1.0.dist-info/RECORD",
        "bin/pkg-cli",
    ):
        assert gone not in left
    assert "vllm/__pycache__/keep.pyc" in left  # the upstream trees are classify()'s business only
    assert removed == {"bin": 1, "__pycache__": 1, "files": 2}
