"""vLLM's compiled kernels for the offline GPU host, slimmed to one GPU architecture.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

#: Compiled extensions the bundle carries (the others link torch's unstable C++ ABI, or serve
#: kernels MiniCPM-o 4.5 does not use: MoE, FlashAttention, FlashMLA, DeepGEMM).
CARRIED = ("vllm/_C_stable_libtorch.abi3.so",)
FATBIN_MAGIC = 0xBA55ED50
_CUBIN = 2


def _section(data: bytes | bytearray, name: bytes) -> tuple[int, int]:
    """``(offset, size)`` of the ELF64 section ``name``.

    Raises:
        ValueError: not a little-endian ELF64 file, or no such section.
    """
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for sh_name, _type, _flags, _addr, offset, size in headers:
        start = names_at + sh_name
        if data[start : data.index(b"\0", start)] == name:
            return offset, size
    raise ValueError(f"no {name.decode()} section")


def zero_foreign_cubins(data: bytearray, arch: int) -> tuple[int, int]:
    """Zero, in ``data``, the payload of every cubin whose architecture is not ``arch`` (e.g. 90).

    Raises:
        ValueError: no ``.nv_fatbin`` section, or no cubin for ``arch`` (a bundle that cannot run).
    """
    offset, size = _section(data, b".nv_fatbin")
    pos, end, kept, zeroed = offset, offset + size, 0, 0
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        entry, container_end = pos + header_size, pos + header_size + fat_size
        while entry < container_end:
            kind, _ver, entry_header, padded = struct.unpack_from("<HHII", data, entry)
            entry_arch, = struct.unpack_from("<I", data, entry + 28)
            if kind == _CUBIN and entry_arch != arch:
                payload = entry + entry_header
                data[payload : payload + padded] = bytes(padded)
                zeroed += 1
            elif kind == _CUBIN:
                kept += 1
            entry += entry_header + padded
        pos = container_end
    if not kept:
        raise ValueError(f"no sm_{arch} cubin in the fat binary")
    return kept, zeroed


def slim(path: Path, arch: int = 90) -> str:
    """Strip ``path`` (``strip --strip-unneeded``) and zero its cubins for other architectures.

    Raises:
        ValueError: see :func:`zero_foreign_cubins`.
        subprocess.CalledProcessError: ``strip`` failed.
    """
    before = path.stat().st_size
    subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
    data = bytearray(path.read_bytes())
    kept, zeroed = zero_foreign_cubins(data, arch)
    path.write_bytes(data)
    return (
        f"{path.name}: {before / 2**20:.1f} -> {len(data) / 2**20:.1f} MiB stripped, "
        f"{kept} sm_{arch} cubins kept, {zeroed} others zeroed"
    )
