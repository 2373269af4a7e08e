"""Save cases run inside the rank group (see rank_group.py): each is called on all
ranks; ranks outside the case's world size return None at once."""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from typing import Any

import torch
from cases_load import full, mesh_for, reference, subgroup
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import streamload
from streamload.io.copy_ops import bit_view as bits


class _Allocations(TorchDispatchMode):
    """Records the largest storage any op allocates (outputs whose storage no input has)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    @staticmethod
    def _storage(t: Any) -> tuple[int, int] | None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a subclass with no storage of its own
            return None
        return st.data_ptr(), st.nbytes()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {s[0] for s in map(self._storage, tree_flatten((args, kwargs))[0]) if s is not None}
        for s in map(self._storage, tree_flatten(out)[0]):
            if s is not None and s[0] not in seen:
                self.largest = max(self.largest, s[1])
        return out


def _files(d: str) -> dict[str, bytes]:
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def _one_step(model: torch.nn.Module) -> None:
    ids = torch.arange(12).reshape(2, 6) % 64
    model.train()
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.eval()


def _fulls(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def case_round_trip(
    rank: int,
    world: int,
    *,
    ckpt: str,
    ws: int,
    out: str,
    load_dtype: torch.dtype | None = None,
    save_dtype: torch.dtype | None = None,
    max_shard_size: str = "24KB",
    bucket_bytes: int = 4096,
    step: bool = False,
    track: bool = False,
) -> dict[str, Any] | None:
    """load -> (step) -> streamload.save_pretrained -> checks against transformers' own save.

    ``track``: record the largest tensor storage any op allocates during the save
    (``allocated`` in the result)."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    group = subgroup(ws)
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, dtype=load_dtype, progress=False)
    if step:
        _one_step(model)
    allocs = _Allocations()
    with allocs if track else contextlib.nullcontext():
        rep = streamload.save_pretrained(
            model,
            out,
            dtype=save_dtype,
            max_shard_size=max_shard_size,
            process_group=group,
            bucket_bytes=bucket_bytes,
        )
    fulls = _fulls(model)
    want = {
        n: t.to(save_dtype) if save_dtype is not None and t.is_floating_point() else t
        for n, t in fulls.items()
    }
    result: dict[str, Any] = {
        "report": rep,
        "largest": max(t.nbytes for t in fulls.values()),
        "allocated": allocs.largest,
    }
    failure: BaseException | None = None
    if rank == 0:
        try:
            if step:  # the saved weights are the trained ones, not the checkpoint's
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    start = dict(reference(ckpt, load_dtype).named_parameters())
                moved = [n for n, t in fulls.items() if not _equal(t, start[n].detach())]
                assert len(moved) > len(fulls) // 2, f"the step changed only {moved}"
            result["files"] = _check_against_transformers(
                out, ckpt, fulls, want, load_dtype, save_dtype, max_shard_size
            )
        except BaseException as exc:  # noqa: BLE001 - raised after the collective reload below
            failure = exc
    # (d) streamload loads its own output bit-exactly.
    again = streamload.from_pretrained(out, device_mesh=mesh, progress=False)
    bad = [n for n, t in _fulls(again).items() if not _equal(t, want[n])]
    assert not bad, f"streamload reloads different tensors: {bad}"
    if failure is not None:
        raise failure
    return result


def _check_against_transformers(
    out: str,
    ckpt: str,
    fulls: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    load_dtype: torch.dtype | None,
    save_dtype: torch.dtype | None,
    max_shard_size: str,
) -> list[str]:
    """(a) transformers reads back ``want``; (b, c) transformers' own save of the gathered
    model writes the same files, tensors and bytes. Returns the file names."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (a) transformers reads the output back as the model's own tensors.
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        bad = [n for n, p in back.named_parameters() if not _equal(p.detach(), want[n])]
        assert not bad, f"transformers reads back different tensors: {bad}"
        # (b, c) transformers' own save of the gathered model: the same files, byte for byte.
        ref = reference(ckpt, load_dtype)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(fulls[n])
        if save_dtype is not None:
            ref = ref.to(save_dtype)
        ref_dir = tempfile.mkdtemp(prefix="streamload_refsave_")
        ref.save_pretrained(ref_dir, max_shard_size=max_shard_size)
    mine, theirs = _files(out), _files(ref_dir)
    assert sorted(mine) == sorted(theirs), (sorted(mine), sorted(theirs))
    for f in theirs:
        if f.endswith(".safetensors"):
            a, b = load_file(os.path.join(out, f)), load_file(os.path.join(ref_dir, f))
            assert sorted(a) == sorted(b), f
            diff = [k for k in a if not _equal(a[k], b[k])]
            assert not diff, f"{f}: tensors differ from transformers' save: {diff}"
        assert mine[f] == theirs[f], f"{f} differs from transformers' save"
    return sorted(mine)


class _Plain(torch.nn.Module):
    """A plain module (no transformers): uneven shapes, a tied pair, a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = torch.nn.Parameter(torch.randn(7, 10, generator=g).to(torch.bfloat16))
        self.col = torch.nn.Parameter(torch.randn(5, 11, generator=g))
        self.row = torch.nn.Parameter(torch.randn(13, 3, 2, generator=g).to(torch.float16))
        self.rep = torch.nn.Parameter(torch.randn(4, generator=g))
        self.head = self.emb  # tied: stored once, under the first name
        self.register_buffer("steps", torch.arange(6, dtype=torch.int64))


def case_plain_tp(
    rank: int, world: int, *, ws: int, out: str, bucket_bytes: int = 64
) -> dict[str, Any] | None:
    """DTensor placements FSDP never makes (Shard(1), Shard(2), Replicate) on a plain module:
    the files equal safetensors' own save of the full tensors, byte for byte."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = _Plain()
    ref = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "head"}
    placements = {"emb": Shard(0), "col": Shard(1), "row": Shard(2), "rep": Replicate()}
    for name, pl in placements.items():
        setattr(model, name, torch.nn.Parameter(distribute_tensor(getattr(model, name).data, mesh, [pl])))
    model.head = model.emb
    rep = streamload.save_pretrained(
        model, out, process_group=subgroup(ws), bucket_bytes=bucket_bytes, max_shard_size="5GB"
    )
    if rank == 0:
        ref_dir = tempfile.mkdtemp(prefix="streamload_refplain_")
        save_file(ref, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
        assert _files(out) == _files(ref_dir)
    return {"report": rep}


def case_one_rank_fails(
    rank: int, world: int, *, ws: int, out: str, where: str, interrupt: bool = False
) -> dict[str, Any] | None:
    """A failure on the last rank only (planning or writing): the same SaveError on every
    rank, naming that rank; nothing at ``out`` and no temporary directory left."""
    import streamload.save.driver as driver
    from streamload.errors import SaveError

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = _Plain()
    from torch.distributed.tensor import Shard, distribute_tensor

    model.col = torch.nn.Parameter(distribute_tensor(model.col.data, mesh, [Shard(1)]))
    saved = getattr(driver, where)

    def boom(*args: Any, **kwargs: Any) -> Any:
        if interrupt:
            raise KeyboardInterrupt
        raise OSError(28, "No space left on device (injected)")

    if rank == ws - 1:
        setattr(driver, where, boom)
    err: BaseException
    try:
        streamload.save_pretrained(model, out, process_group=subgroup(ws))
    except (SaveError, KeyboardInterrupt) as exc:
        err = exc
    else:
        raise AssertionError("the save did not fail")
    finally:
        setattr(driver, where, saved)
    if interrupt and rank == ws - 1:
        assert isinstance(err, KeyboardInterrupt), repr(err)  # the interrupt stays one where it happened
    else:
        assert isinstance(err, SaveError) and err.rank == ws - 1, repr(err)
    parent = os.path.dirname(out)
    assert not os.path.exists(out) and os.listdir(parent) == [], os.listdir(parent)
    return {"error": str(err) if isinstance(err, SaveError) else repr(err)}


def case_extra_files(rank: int, world: int, *, ws: int, out: str) -> dict[str, Any] | None:
    """``extra_files`` (rank 0's tokenizer and the like) go into the temporary directory: a save
    commits them with the weights; one whose extra files fail on rank 0 (half a file written)
    is a SaveError on every rank, naming rank 0, and leaves the previous checkpoint as it was."""
    from streamload.errors import SaveError

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = _Plain()
    from torch.distributed.tensor import Shard, distribute_tensor

    model.col = torch.nn.Parameter(distribute_tensor(model.col.data, mesh, [Shard(1)]))

    def tokenizer(version: int, fail: bool) -> Any:
        def write(tmp: str) -> None:
            with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
                f.write(f'{{"version": {version}, "vocab": ')
                if fail:
                    raise OSError(28, "No space left on device (injected, tokenizer)")
                f.write("{}}")

        return write

    streamload.save_pretrained(model, out, process_group=subgroup(ws), extra_files=tokenizer(1, False))
    before = _files(out)
    with torch.no_grad():
        model.col.to_local().add_(1.0)  # the next save's weights differ
    err: BaseException | None = None
    try:
        streamload.save_pretrained(model, out, process_group=subgroup(ws), extra_files=tokenizer(2, True))
    except SaveError as exc:
        err = exc
    assert isinstance(err, SaveError) and err.rank == 0 and "tokenizer" in str(err), repr(err)
    assert _files(out) == before, "a failed save changed the checkpoint"
    parent = os.path.dirname(out)
    return {"names": sorted(before), "tokenizer": before["tokenizer.json"], "left": sorted(os.listdir(parent))}
