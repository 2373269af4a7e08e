"""Throughput of the native dequantizing ops against transformers' own
dequantization of the same tensors (best of 3, one process):

    python benchmarks/bench_dequant.py --threads 2

FP8 block-scaled [7168, 4096] (a DeepSeek-V3 projection) -> bf16, and MXFP4
GPT-OSS experts [4, 5760, 90, 16] -> bf16 in transformers' [E, H, 2I] layout.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from streamload.io import _native
from streamload.io.copy_ops import OpBatch


def best(fn: Callable[[], object], n: int = 3) -> float:
    out = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def _mem(t: torch.Tensor, dtype: str) -> tuple[int, int, int, str]:
    return (-1, t.data_ptr(), t.numel() * t.element_size(), dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    engine = _native.CopyEngine(args.threads)
    rows, cols = 7168, 4096
    w = torch.randint(0, 126, (rows, cols), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(rows // 128, cols // 128)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)

    def fp8() -> None:
        batch = OpBatch()
        batch.add_dequant(
            kind="fp8_block", weight=_mem(w, "F8_E4M3"), scale=_mem(s, "F32"), dst=out, dst_dtype="BF16",
            dims=(1, rows, cols), block=(128, 128), box=((0, 1), (0, rows), (0, cols)), dst_offset=0,
            dst_strides=(0, cols, 1),
        )  # fmt: skip
        batch.execute(engine, [])

    a, b = best(fp8), best(lambda: Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.bfloat16))
    print(
        f"fp8 [{rows}, {cols}] -> bf16: streamload {a * 1e3:.0f} ms, transformers {b * 1e3:.0f} ms ({b / a:.1f}x)"
    )

    n_exp, r2, groups = 4, 5760, 90
    hidden = groups * 32
    blocks = torch.randint(0, 256, (n_exp, r2, groups, 16), dtype=torch.uint8)
    scales = torch.randint(120, 130, (n_exp, r2, groups), dtype=torch.uint8)
    out2 = torch.empty(n_exp, hidden, r2, dtype=torch.bfloat16)

    def mxfp4() -> None:
        batch = OpBatch()
        batch.add_dequant(
            kind="mxfp4", weight=_mem(blocks, "U8"), scale=_mem(scales, "U8"), dst=out2, dst_dtype="BF16",
            dims=(n_exp, r2, hidden), block=(1, 32), box=((0, n_exp), (0, r2), (0, hidden)), dst_offset=0,
            dst_strides=(hidden * r2, 1, r2),
        )  # fmt: skip
        batch.execute(engine, [])

    a, b = best(mxfp4), best(lambda: convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16), n=2)
    print(
        f"mxfp4 [{n_exp}, {r2}, {groups}, 16] -> bf16 [E, H, 2I]: streamload {a * 1e3:.0f} ms, "
        f"transformers {b * 1e3:.0f} ms ({b / a:.1f}x)"
    )


if __name__ == "__main__":
    main()
