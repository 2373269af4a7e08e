"""GPU tests: one NCCL rank on a CUDA device. Skipped without CUDA; run by
benchmarks/gpu_check.sh on a GPU machine. Their CPU halves (slot reuse, side
group, offload on a CPU mesh) are in tests/test_gpu_path.py."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from streamload.tools.synthetic import make_checkpoint

    root = tmp_path_factory.mktemp("gpu")
    return {
        "moe": str(
            make_checkpoint(root / "moe", "qwen3_moe", tie=True, seed=3, num_experts=5, max_shard_size="30KB")
        ),
        # ~100 MB, many files: big enough that a copy still in flight would be seen.
        "dense": str(
            make_checkpoint(
                root / "dense",
                "qwen2",
                tie=True,
                seed=4,
                layers=4,
                vocab=8192,
                hidden_size=768,
                intermediate_size=2304,
                num_attention_heads=8,
                num_key_value_heads=4,
                max_shard_size="20MB",
            )
        ),
    }


def _reference(ckpt: str, dtype: torch.dtype | None) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype or "auto")


def _assert_equal(model: Any, ref: Any) -> None:
    from streamload.io.copy_ops import bit_view

    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        # One rank: the local shard is the whole tensor, on whatever device it lives (an
        # offloaded shard on the CPU cannot go through NCCL's all-gather).
        got = p.to_local() if hasattr(p, "to_local") else p
        want = ref_params[name]
        assert got.dtype == want.dtype and torch.equal(bit_view(got.cpu()), bit_view(want)), name


def _process_groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _pinned_cache() -> int:
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.current", 0))


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_nccl_world_size_one_matches_transformers_and_releases(mesh, ckpts, readers: str) -> None:
    import streamload
    from streamload.transport import staging

    # An earlier test may have left cached blocks: measure what this load adds.
    gc.collect()
    before = (torch.cuda.memory_allocated(), _pinned_cache(), _process_groups())
    model = streamload.from_pretrained(
        ckpts["moe"],
        device_mesh=mesh,
        dtype=torch.float32,
        progress=False,
        readers=readers,
        bucket_bytes=8192,
    )
    assert model.streamload_report.reader.startswith(readers), model.streamload_report.reader
    _assert_equal(model, _reference(ckpts["moe"], torch.float32))
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert model.lm_head.weight is model.get_input_embeddings().weight
    shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    shards += sum(b.numel() * b.element_size() for b in model.buffers())
    # Exactly the model stays: staging and receive buffers were given back, pinned slots
    # unregistered (torch's pinned cache did not grow), and no process group was left.
    assert torch.cuda.memory_allocated() - before[0] <= shards + (1 << 20)
    assert _pinned_cache() == before[1]
    assert staging.registered_bytes() == 0
    assert _process_groups() == before[2]


def test_many_small_buckets_through_the_owners_pipeline(mesh, ckpts) -> None:
    import streamload

    # 64 KiB buckets: ~1500 of them through 2 host slots, each repacked as soon as its copy is done.
    model = streamload.from_pretrained(
        ckpts["dense"], device_mesh=mesh, progress=False, readers="owners", bucket_bytes=64 << 10
    )
    assert model.streamload_report.buckets > 1000
    _assert_equal(model, _reference(ckpts["dense"], None))


def test_load_never_empties_the_process_cache(mesh, ckpts, monkeypatch: pytest.MonkeyPatch) -> None:
    import streamload

    def refuse() -> None:
        raise AssertionError("streamload emptied the whole process's CUDA cache")

    monkeypatch.setattr(torch.cuda, "empty_cache", refuse)
    for readers in ("src", "owners"):
        streamload.from_pretrained(ckpts["moe"], device_mesh=mesh, progress=False, readers=readers)


def test_cpu_offload_materialises_on_the_cpu(mesh, ckpts) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    import streamload
    from streamload.model.state import rebind_ties, record_state

    ckpt = ckpts["dense"]
    config = AutoConfig.from_pretrained(ckpt)
    for readers in ("src", "owners"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
        rebind_ties(model, record_state(model).ties)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        streamload.load_checkpoint(
            model, ckpt, device_mesh=mesh, progress=False, readers=readers, bucket_bytes=4 << 20
        )
        shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        # No shard was ever allocated on the GPU: only staging buffers and the (small) buffers.
        assert torch.cuda.max_memory_allocated() - base < shards / 2
        assert all(p.to_local().device.type == "cpu" and p.to_local().is_pinned() for p in model.parameters())
        assert all(b.device.type == "cuda" for b in model.buffers())
        _assert_equal(model, _reference(ckpt, None))
        ids = torch.arange(8, device="cuda").view(1, 8)
        model(input_ids=ids).logits.float().sum().backward()


def test_fsdp2_cpu_offload_returns_finished_copies(mesh, ckpts) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    import streamload
    from streamload.integrations.pretrained import default_shard_fn
    from streamload.io.copy_ops import bit_view

    ckpt = ckpts["dense"]
    # The reference is built first: building it after the load would give
    # in-flight device-to-host copies time to finish and hide a missing sync.
    ref = dict(_reference(ckpt, None).named_parameters())
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    default_shard_fn(model, mesh)
    synced: list[Any] = []
    real_sync = torch.cuda.synchronize

    def sync(device: Any = None) -> None:
        synced.append(torch.device(device) if device is not None else None)
        real_sync(device)

    torch.cuda.synchronize = sync  # type: ignore[assignment]
    try:
        streamload.fsdp2_load_full_state_dict(model, streamload.Checkpoint(ckpt), mesh, cpu_offload=True)
        # Read straight away: the parameters' device-to-host copies must be complete.
        got = {n: bit_view(p.to_local()).clone() for n, p in model.named_parameters()}
    finally:
        torch.cuda.synchronize = real_sync  # type: ignore[assignment]
    assert torch.device("cuda", torch.cuda.current_device()) in synced, synced
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    for name, want in ref.items():
        assert torch.equal(got[name], bit_view(want)), name


@pytest.mark.parametrize("writers", ["owners", "src"])
def test_save_round_trip_on_the_gpu(
    mesh, ckpts, tmp_path: Path, writers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 masters on the GPU saved in the checkpoint's bf16: transformers' files, byte for byte
    (the checkpoint is transformers' own save), read back by transformers as the same model.
    Every piece left the device through the two page-locked slots (``save.stage``)."""
    from safetensors.torch import load_file

    import streamload
    from streamload.io.copy_ops import bit_view
    from streamload.save import stage
    from streamload.transport.staging import registered_bytes

    readers: list[stage.DeviceReader] = []
    real_init = stage.DeviceReader.__init__

    def init(self: stage.DeviceReader, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        readers.append(self)

    monkeypatch.setattr(stage.DeviceReader, "__init__", init)

    ckpt = ckpts["moe"]
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=torch.float32, progress=False)
    gc.collect()
    before = (torch.cuda.memory_allocated(), _process_groups())
    out = tmp_path / "out"
    report = streamload.save_pretrained(
        model, out, dtype=torch.bfloat16, writers=writers, max_shard_size="30KB", bucket_bytes=8192
    )
    assert report.writers == writers
    names = sorted(p.name for p in Path(ckpt).iterdir() if "safetensors" in p.name)
    assert names == sorted(p.name for p in out.iterdir() if "safetensors" in p.name)
    for name in names:
        if name.endswith(".safetensors"):
            got, want = load_file(out / name), load_file(Path(ckpt) / name)
            assert sorted(got) == sorted(want), name
            for key, value in want.items():
                assert torch.equal(bit_view(got[key]), bit_view(value)), (name, key)
        assert (out / name).read_bytes() == (Path(ckpt) / name).read_bytes(), name
    _assert_equal(_reference(str(out), torch.float32), _reference(ckpt, torch.float32))
    assert readers and all(r.staging == "pinned" and r.copies > 0 for r in readers), readers
    assert registered_bytes() == 0  # the slots were unregistered
    # Nothing stays behind on the device, and the save's gloo twin (if any) is gone.
    gc.collect()
    assert torch.cuda.memory_allocated() <= before[0] and _process_groups() == before[1]


def test_fp8_save_from_the_gpu_equals_the_cpu_save(mesh, ckpts, tmp_path: Path) -> None:
    """quantize="fp8" of GPU shards: staged to the host in float32, quantized there, the same
    files as the save of the same weights held on the CPU."""
    import streamload

    ckpt = ckpts["moe"]
    gpu = streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=torch.float32, progress=False)
    cpu = _reference(ckpt, torch.float32)
    streamload.save_pretrained(gpu, tmp_path / "gpu", quantize="fp8", max_shard_size="30KB")
    streamload.save_pretrained(cpu, tmp_path / "cpu", quantize="fp8", max_shard_size="30KB")
    for p in sorted((tmp_path / "cpu").iterdir()):
        assert (tmp_path / "gpu" / p.name).read_bytes() == p.read_bytes(), p.name


def test_one_gpu_takes_the_multi_rank_paths(mesh, ckpts, tmp_path: Path) -> None:
    """STREAMLOAD_FORCE_MULTI_RANK on one NCCL rank: every reader mode through NCCL's
    all_to_all and the status flags on a gloo side group, both writers, bit-exact (the same
    run as tests/test_world1_paths.py on one gloo rank)."""
    from cases_world1 import forced, run_world1

    before = _process_groups()
    with forced():
        res = run_world1(ckpts["moe"], str(tmp_path), mesh)
    assert [r.split(":")[0] for r in res["reader"]] == ["src", "owners", "node"], res["reader"]
    for mode in ("src", "owners", "node"):
        calls = res[f"load:{mode}"]
        assert calls.get("new_group:gloo") == 1, (mode, calls)  # the load's side group
        assert calls.get("all_reduce", 0) >= 1 and calls.get("all_gather", 0) >= 4, (mode, calls)
        assert mode == "owners" or calls.get("all_to_all_single", 0) > 3, (mode, calls)
    for writers in ("owners", "src"):
        calls = res[f"save:{writers}"]
        assert calls.get("new_group:gloo") == 1 and calls.get("all_gather", 0) >= 4, (writers, calls)
    assert res["save:src"].get("all_to_all_single", 0) > 0, res
    assert _process_groups() == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_device_comes_from_the_model_not_current_device(mesh, ckpts, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    import streamload

    ckpt = ckpts["moe"]
    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt)).to("cuda:1")
    streamload.load_checkpoint(model, ckpt, progress=False)
    assert {p.device for p in model.parameters()} == {torch.device("cuda", 1)}
    _assert_equal(model, _reference(ckpt, torch.float32))


def _tiny_qwen2(root: Path, dtype: torch.dtype) -> Path:
    from streamload.tools.synthetic import make_checkpoint

    return make_checkpoint(
        root,
        "qwen2",
        dtype=dtype,
        seed=11,
        layers=2,
        vocab=64,
        hidden_size=32,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def test_missing_weights_initialise_without_the_dtensor_rng_tracker(mesh, tmp_path: Path) -> None:
    """#43 item 6: strict=False on a CUDA mesh. The first DTensor random op would create torch's
    OffsetBasedRNGTracker (a broadcast over the default group); the missing weights are drawn on
    the CPU instead, equal to a non-sharded init with the reader's seed."""
    import torch.distributed.tensor._random as dtensor_random
    from safetensors.torch import load_file, save_file
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    import streamload
    from streamload.io.copy_ops import bit_view
    from streamload.model.missing import fill_uncovered

    ckpt = _tiny_qwen2(tmp_path / "holes", torch.float32)
    missing = "model.layers.0.mlp.down_proj.weight"
    sd = load_file(str(ckpt / "model.safetensors"))
    del sd[missing]
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    created: list[Any] = []
    real_init = dtensor_random.OffsetBasedRNGTracker.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        created.append(args)
        real_init(self, *args, **kwargs)

    saved_tracker, dtensor_random._rng_tracker = dtensor_random._rng_tracker, None
    dtensor_random.OffsetBasedRNGTracker.__init__ = init  # type: ignore[method-assign]
    torch.manual_seed(1234)
    try:
        report = streamload.load_checkpoint(model, ckpt, device_mesh=mesh, strict=False, progress=False)
        assert dtensor_random._rng_tracker is None and created == [], created
    finally:
        dtensor_random.OffsetBasedRNGTracker.__init__ = real_init  # type: ignore[method-assign]
        dtensor_random._rng_tracker = saved_tracker
    assert report.missing_keys == [missing]
    cpu = AutoModelForCausalLM.from_config(config)
    fill_uncovered(cpu, [missing], {}, seed=1234)  # a non-sharded init with the same seed
    got = model.get_parameter(missing).to_local()
    assert got.device.type == "cuda"
    assert torch.equal(bit_view(got.cpu()), bit_view(cpu.get_parameter(missing)))


@pytest.mark.parametrize("readers", ["src", "owners"])
def test_nan_payloads_load_with_the_cpus_bits(mesh, tmp_path: Path, readers: str) -> None:
    """#43 item 7: on sm_80+ a device's f32 -> bf16 writes every NaN 0x7FFF (torch's CPU: 0xFFFF),
    fp8 -> bf16 0x7FFF (CPU 0x7FC0): every cast of a device load must give the CPU's bits."""
    from cases_nan_casts import put_nans
    from safetensors.torch import load_file, save_file

    import streamload

    base = _tiny_qwen2(tmp_path / "base", torch.float32)
    sd = load_file(str(base / "model.safetensors"))
    cases = [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16),
        (torch.float16, torch.bfloat16),
        (torch.float8_e4m3fn, torch.bfloat16),
        (torch.float8_e4m3fn, torch.float32),
    ]
    for src, dst in cases:
        ckpt = tmp_path / f"{src}-{dst}-{readers}".replace("torch.", "")
        ckpt.mkdir()
        for f in base.iterdir():
            if f.suffix != ".safetensors":
                (ckpt / f.name).write_bytes(f.read_bytes())
        nan_sd = {k: put_nans(v.to(src)) if v.dim() == 2 else v.to(src) for k, v in sd.items()}
        save_file(nan_sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        model = streamload.from_pretrained(
            str(ckpt), device_mesh=mesh, dtype=dst, progress=False, readers=readers, bucket_bytes=4096
        )
        assert all(p.to_local().device.type == "cuda" for p in model.parameters())
        _assert_equal(model, _reference(str(ckpt), dst))
