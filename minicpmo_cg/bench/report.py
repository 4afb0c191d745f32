"""The benchmark's report on stdout: a header, one section per scenario that ran, the problems."""

from __future__ import annotations

from typing import Any

from minicpmo_cg.bench import (
    duplex,
    duplex_concurrency,
    offline,
    per_shape,
    streaming,
    vision_path,
)


def _header(meta: dict[str, Any]) -> list[str]:
    lines = [
        "=== RESULTS: encoder CUDA graph benchmark ===",
        (
            f"device {meta['device_name']} | torch {meta['torch']} | vllm {meta['vllm']} "
            f"| vllm-omni {meta['vllm_omni']} "
            f"| {meta['dtype']} | mode {meta['mode']} | model {meta['model']}"
        ),
    ]
    if meta["mode"] == "cpu":
        lines.append(
            "CPU DRY RUN (--allow-cpu): tiny shapes, eager stand-in for capture; numbers are meaningless"
        )
    return lines


def format_report(res: dict[str, Any]) -> str:
    lines = _header(res["meta"])
    rows = res.get("vision", []) + res.get("audio", [])
    if rows:
        lines += per_shape.format_rows(rows)
    for key, fmt in (
        ("vision_path", vision_path.format_section),
        ("streaming", streaming.format_section),
        ("duplex", duplex.format_section),
        ("duplex_concurrency", duplex_concurrency.format_section),
        ("offline", offline.format_section),
    ):
        if res.get(key):
            lines += fmt(res[key])
    if res["problems"]:
        lines += ["\nPROBLEMS:"] + [f"  {prob}" for prob in res["problems"]]
    lines.append(f"\nelapsed {res['meta']['elapsed_s']:.0f} s; sections {', '.join(res['meta']['sections'])}")
    return "\n".join(lines)
