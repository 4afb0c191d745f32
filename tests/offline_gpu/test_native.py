"""CPU checks of the carried compiled kernels: the sm_90 slimming and the host-side fallback to the stub."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from minicpmo_cg.offline_gpu import hostenv, native

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = struct.pack("<HHII", kind, 1, 64, len(payload)) + bytes(16) + struct.pack("<I", arch)
    return header + bytes(64 - len(header)) + payload


def _elf_with_fatbin(entries: list[bytes]) -> bytes:
    """A minimal ELF64 file whose only sections are ``.nv_fatbin`` (one container) and the names."""
    body = b"".join(entries)
    fatbin = struct.pack("<IHHQ", native.FATBIN_MAGIC, 1, 16, len(body)) + body
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_at, names_at = 64, 64 + len(fatbin)
    shoff = names_at + len(names)
    header = b"\x7fELF\x02\x01\x01" + bytes(9) + bytes(24) + struct.pack("<Q", shoff) + bytes(10)
    header += struct.pack("<HHH", 64, 3, 2)
    sections = bytes(64)  # the null section
    sections += struct.pack("<IIQQQQ", 1, 1, 0, 0, fat_at, len(fatbin)) + bytes(24)
    sections += struct.pack("<IIQQQQ", 12, 3, 0, 0, names_at, len(names)) + bytes(24)
    return header + fatbin + names + sections


def test_only_cubins_of_the_target_architecture_keep_their_payload() -> None:
    sm90, sm80, ptx80 = b"\x90" * 32, b"\x80" * 32, b"\x70" * 32
    data = bytearray(_elf_with_fatbin([_entry(2, 80, sm80), _entry(2, 90, sm90), _entry(1, 80, ptx80)]))
    assert native.zero_foreign_cubins(data, 90) == (1, 1)
    assert sm90 in data and ptx80 in data and sm80 not in data  # PTX still JIT-compiles for sm_90


def test_a_fat_binary_without_the_target_architecture_is_refused() -> None:
    data = bytearray(_elf_with_fatbin([_entry(2, 80, b"\x80" * 32)]))
    with pytest.raises(ValueError, match="no sm_90 cubin"):
        native.zero_foreign_cubins(data, 90)
    with pytest.raises(ValueError, match="no .nv_fatbin"):
        native.zero_foreign_cubins(bytearray(_elf_with_fatbin([]).replace(b".nv_fatbin", b".nv_fatbxn")), 90)


def test_kernels_that_do_not_load_give_way_to_the_stub_with_a_warning(tmp_path: Path) -> None:
    so = tmp_path / native.CARRIED[0]
    so.parent.mkdir(parents=True)
    (so.parent / "__init__.py").write_text("")
    so.write_bytes(b"\x7fELF not a real extension")
    line = hostenv.load_kernels(tmp_path, sys.executable)
    assert line.startswith("WARNING: vLLM's compiled kernels do not load here")
    assert not so.exists() and so.with_name(so.name + ".unloadable").is_file()
    assert hostenv.load_kernels(tmp_path, sys.executable).startswith("WARNING: the bundle carries no")


def test_the_checkouts_vllm_plugins_are_registered_in_the_site(tmp_path: Path) -> None:
    import importlib.metadata

    from minicpmo_cg.offline_gpu import cli

    hostenv.register_entry_points(tmp_path, cli.REPO)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    plugins = {ep.name: ep.value for ep in dist.entry_points if ep.group == "vllm.general_plugins"}
    assert plugins["minicpmo_cg_thinker_only"] == "minicpmo_cg.omni_plugin:register_thinker_only"
    assert plugins["minicpmo_cg_patch_check"] == "minicpmo_cg.vllm_plugin:check_patch_set"


def test_host_environment_keeps_vllm_off_the_flashinfer_it_does_not_carry() -> None:
    # vLLM's sampler imports FlashInfer on CUDA unless VLLM_USE_FLASHINFER_SAMPLER=0.
    deps = (Path(native.__file__).parent / "deps.txt").read_text().lower()
    assert "flashinfer" not in deps
    env = {**hostenv.environment(Path("/nonexistent-site"), Path.cwd()), "PATH": ""}
    code = "import vllm.envs as e; print(e.VLLM_USE_FLASHINFER_SAMPLER)"
    env.pop("PYTHONPATH")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
