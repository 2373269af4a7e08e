"""GPU tests: NCCL world size 1 and the CUDA kernels. Skipped without CUDA;
run by benchmarks/gpu_check.sh on a GPU machine."""

from __future__ import annotations

import os

import pytest
import torch

from streamload.io import _native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_widen_kernels_match_torch() -> None:
    cuda = _native.cuda_module()
    assert cuda is not None, "built without the CUDA extension (STREAMLOAD_CUDA=ON)"
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        src = (torch.randn(1 << 20, generator=gen) * 100).to(dtype).cuda()
        out = torch.empty(src.shape, dtype=torch.float32, device="cuda")
        cuda.widen_to_f32(
            src.data_ptr(),
            out.data_ptr(),
            src.numel(),
            dtype == torch.bfloat16,
            torch.cuda.current_stream().cuda_stream,
        )
        torch.cuda.synchronize()
        assert torch.equal(out, src.float())


def test_nccl_world_size_one_matches_transformers(tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    import streamload
    from streamload.tools.synthetic import make_checkpoint

    ckpt = make_checkpoint(
        tmp_path / "ck", "qwen3_moe", tie=True, seed=3, num_experts=5, max_shard_size="30KB"
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        mesh = init_device_mesh("cuda", (1,))
        before = torch.cuda.memory_allocated()
        model = streamload.from_pretrained(str(ckpt), device_mesh=mesh, dtype=torch.float32, progress=False)
        ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
        for name, p in model.named_parameters():
            assert p.device.type == "cuda"
            assert torch.equal(p.full_tensor().cpu(), dict(ref.named_parameters())[name]), name
        assert model.lm_head.weight is model.get_input_embeddings().weight
        shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        # What streamload allocated on the device beyond the shards is released.
        assert torch.cuda.memory_allocated() - before <= shards + (1 << 20)
    finally:
        dist.destroy_process_group()
