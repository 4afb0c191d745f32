"""A micro-benchmark of batch-invariant GEMMs for Whisper-medium's ``fc2`` (K = 4096, N = 1024, bf16)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import torch

K, N, CHUNK = 4096, 1024, 50
SESSIONS = (1, 2, 4, 8, 16, 32)


def _inputs(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn((m, K), generator=g, device="cuda").bfloat16()
    w = (torch.randn((N, K), generator=g, device="cuda") / 64).bfloat16()
    return x, w


def _ms(fn: Any, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _invariant(gemm: Any, x: torch.Tensor, w: torch.Tensor) -> bool:
    out = gemm(x, w)
    return all(
        torch.equal(out[r : r + CHUNK], gemm(x[r : r + CHUNK], w)) for r in range(0, x.shape[0], CHUNK)
    )


def _row_by_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((x.shape[0], w.shape[0]))
    for r in range(0, x.shape[0], CHUNK):
        torch.mm(x[r : r + CHUNK], w.t(), out=out[r : r + CHUNK])
    return out


def _triton_gemm() -> Any:
    """``x @ w.T`` by a Triton kernel with one tile shape (64 x 64 x 64) whatever M: a row's sum runs over K in
    the same order in every call. None when Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(
        x, w, out, m, n, k, sxm, sxk, swn, swk, som, son, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
    ):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm, rn, rk = pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN), tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, k, BK):
            a = tl.load(x + rm[:, None] * sxm + (k0 + rk)[None, :] * sxk, mask=rm[:, None] < m, other=0.0)
            b = tl.load(w + rn[None, :] * swn + (k0 + rk)[:, None] * swk, mask=rn[None, :] < n, other=0.0)
            acc += tl.dot(a, b)
        tl.store(
            out + rm[:, None] * som + rn[None, :] * son,
            acc.to(tl.bfloat16),
            mask=(rm[:, None] < m) & (rn[None, :] < n),
        )

    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        out = x.new_empty((m, w.shape[0]))
        grid = (triton.cdiv(m, 64), triton.cdiv(w.shape[0], 64))
        kernel[grid](
            x, w, out, m, w.shape[0], x.shape[1], *x.stride(), *w.stride(), *out.stride(), BM=64, BN=64, BK=64
        )
        return out

    return gemm


def measure(ways: dict[str, Any], repeats: int) -> dict[str, dict[str, Any]]:
    rows = {}
    for sessions in SESSIONS:
        x, w = _inputs(sessions * CHUNK)
        rows[str(sessions)] = {
            name: {"ms": _ms(lambda g=gemm: g(x, w), repeats), "invariant": _invariant(gemm, x, w)}
            for name, gemm in ways.items()
        }
    return rows


def _child(repeats: int) -> dict[str, Any]:
    """The ``workspace`` way, run where the environment was set before cuBLAS started."""
    for flag in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
        setattr(torch.backends.cuda.matmul, flag, False)
    return measure({"workspace": torch.nn.functional.linear}, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("the fc2 micro-benchmark needs CUDA", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(_child(args.repeats)))
        return 0
    ways = {"batched": torch.nn.functional.linear, "row_by_row": _row_by_row}
    triton_gemm = _triton_gemm()
    if triton_gemm is not None:
        ways["triton"] = triton_gemm
    rows = measure(ways, args.repeats)
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    child = subprocess.run(
        [sys.executable, "-m", "minicpmo_cg.bench.fc2", "--child", "--repeats", str(args.repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode == 0:
        for n, row in json.loads(child.stdout.strip().splitlines()[-1]).items():
            rows[n].update(row)
    else:
        print(f"workspace way failed: {child.stderr[-1000:]}", file=sys.stderr)
    names = list(next(iter(rows.values())))
    print(
        f"fc2 GEMM (K={K}, N={N}, bf16) on {torch.cuda.get_device_name()}: ms per GEMM (median), * = batch-invariant"
    )
    print(f"{'sessions':>8s}{'M':>6s}" + "".join(f"{n:>14s}" for n in names))
    for n, row in rows.items():
        cells = "".join(f"{row[w]['ms']:13.4f}{'*' if row[w]['invariant'] else ' '}" for w in names)
        print(f"{n:>8s}{int(n) * CHUNK:6d}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "K": K, "N": N, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
