"""Cases for tests/test_client_verl_save.py and tests/test_client_areal_save.py: the frameworks'
own HF save code (verl 0.9.1's ``FSDPCheckpointManager.save_checkpoint`` with ``hf_model``, its
model merger; AReaL 1.0.4's ``FSDPEngine._save_model_to_hf``) against streamload's entries on the
same model, the two output directories compared tensor by tensor and file by file."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

# JSON keys whose values may legitimately differ between the two saves, per file.
LEGIT: dict[str, set[str]] = {}


def tiny_tokenizer(vocab: int) -> Any:
    """A word-level fast tokenizer over ``vocab`` ids (its files are what the frameworks save)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def _files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names}


def _tensors(root: str, names: set[str]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for name in sorted(n for n in names if n.endswith(".safetensors")):
        with safe_open(os.path.join(root, name), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
                out[key] = (str(t.dtype), tuple(t.shape), raw.numpy().tobytes())
    return out


def compare_dirs(
    own: str,
    ours: str,
    legit: dict[str, set[str]] | None = None,
    aliases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The differences between two HF directories: file names; every tensor's dtype, shape and
    bytes (by name, whatever file holds it); JSON files parsed (keys in ``legit[file]`` listed
    apart, as legitimate); other files byte for byte. ``aliases``: tie alias -> canonical name
    that only the framework's directory may hold, legitimately when its dtype, shape and bytes
    are the canonical tensor's (a tie stored twice).

    Returns:
        ``{"diff": [...], "legit": [...], "tensors": n, "identical_files": [...]}``.
    """
    legit = legit or {}
    diff: list[str] = []
    allowed: list[str] = []
    fa, fb = _files(own), _files(ours)
    if fa != fb:
        diff.append(
            f"files: only in the framework's {sorted(fa - fb)}, only in streamload's {sorted(fb - fa)}"
        )
    ta, tb = _tensors(own, fa), _tensors(ours, fb)
    dropped: set[str] = set()
    for alias, canonical in (aliases or {}).items():
        if alias in ta and alias not in tb and ta[alias] == ta.get(canonical):
            allowed.append(f"tensor {alias}: stored again by the framework (the tie to {canonical})")
            del ta[alias]
            dropped.add(alias)
    if ta.keys() != tb.keys():
        diff.append(
            f"tensors: only in the framework's {sorted(ta.keys() - tb.keys())[:8]}, "
            f"only in streamload's {sorted(tb.keys() - ta.keys())[:8]}"
        )
    for k in sorted(ta.keys() & tb.keys()):
        (da, sa, ba), (db, sb, bb) = ta[k], tb[k]
        if (da, sa) != (db, sb):
            diff.append(f"tensor {k}: {da}{list(sa)} vs {db}{list(sb)}")
        elif ba != bb:
            diff.append(f"tensor {k}: bytes differ")
    identical = []
    for name in sorted(fa & fb):
        with open(os.path.join(own, name), "rb") as f:
            a = f.read()
        with open(os.path.join(ours, name), "rb") as f:
            b = f.read()
        if a == b:
            identical.append(name)
            continue
        if name.endswith(".safetensors"):
            continue  # compared tensor by tensor above
        if name.endswith(".json"):
            ja, jb = json.loads(a), json.loads(b)
            if name.endswith(".index.json"):
                # metadata's total_size follows from the tensors, compared above
                ja = {k: v for k, v in ja["weight_map"].items() if k not in dropped}
                jb = jb["weight_map"]
            keys = set(ja) | set(jb) if isinstance(ja, dict) and isinstance(jb, dict) else {None}
            for key in sorted(keys, key=str):
                va = ja.get(key) if key is not None else ja
                vb = jb.get(key) if key is not None else jb
                if va != vb:
                    (allowed if key in legit.get(os.path.basename(name), set()) else diff).append(
                        f"{name}[{key}]: {va!r} vs {vb!r}"
                    )
            continue
        diff.append(f"{name}: bytes differ")
    return {"diff": diff, "legit": allowed, "tensors": len(ta), "identical_files": identical}


def flip_check(own: str, ours: str) -> list[str]:
    """The comparison must catch one flipped byte of one tensor: flips it in a copy of ``ours``."""
    bad = ours.rstrip("/") + "_flipped"
    shutil.copytree(ours, bad)
    name = sorted(n for n in _files(bad) if n.endswith(".safetensors"))[0]
    path = os.path.join(bad, name)
    with open(path, "r+b") as f:
        head = int.from_bytes(f.read(8), "little")
        f.seek(8 + head + 1)
        byte = f.read(1)
        f.seek(8 + head + 1)
        f.write(bytes([byte[0] ^ 0x10]))
    return compare_dirs(own, bad)["diff"]


# -- verl ---------------------------------------------------------------------------------
def _verl_model(ckpt: str) -> Any:
    from streamload.integrations.frameworks import fsdp2_load_full_state_dict
    from streamload.tools.verl_engine import build_engine_model, verl_mesh

    # verl's engine build (fp32 masters); the loader does not matter here, streamload's is quicker.
    return build_engine_model(ckpt, verl_mesh(), torch.float32, loader=fsdp2_load_full_state_dict)


def _verl_manager(cls: Any, model: Any, tokenizer: Any, contents: list[str]) -> Any:
    return cls(
        model=model,
        optimizer=None,
        lr_scheduler=None,
        processing_class=tokenizer,
        checkpoint_config={"save_contents": contents, "load_contents": ["model"]},
    )


def case_verl_hf_model(rank: int, world: int, *, ckpt: str, out: str, flip: bool = False) -> dict:
    """verl's engine model, then ``FSDPCheckpointManager.save_checkpoint`` with ``hf_model``
    (verl's own class, then streamload's) into two step directories; rank 0 compares
    their ``huggingface/`` directories."""
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as VerlManager

    from streamload.integrations.verl_save import FSDPCheckpointManager

    model = _verl_model(ckpt)
    tok = tiny_tokenizer(model.config.vocab_size)
    for name, cls in (("own", VerlManager), ("streamload", FSDPCheckpointManager)):
        manager = _verl_manager(cls, model, tok, ["hf_model"])
        manager.save_checkpoint(os.path.join(out, name), global_step=1, max_ckpt_to_keep=None)
    dist.barrier()
    if rank != 0:
        return {}
    a, b = os.path.join(out, "own", "huggingface"), os.path.join(out, "streamload", "huggingface")
    res = compare_dirs(a, b, LEGIT_VERL)
    res["steps_equal"] = sorted(_files(os.path.join(out, "own"))) == sorted(
        _files(os.path.join(out, "streamload"))
    )
    if flip:
        res["flipped"] = flip_check(a, b)
    return res


# verl's empty save copy is built in bf16 (``from_config(torch_dtype=torch.bfloat16)``) and
# transformers writes that copy's dtype into config.json, while the tensors keep the state
# dict's (fp32 masters): verl's config.json says "bfloat16" over float32 weights;
# streamload's says the dtype the weights have.
LEGIT_VERL: dict[str, set[str]] = {"config.json": {"dtype"}}


# AReaL's full state dict holds the tied head as a tensor of its own (DCP's gather makes one CPU
# tensor per key, which defeats transformers' storage-based dedup): its checkpoint stores
# the embedding twice; streamload stores the tie once, as transformers does for the model.
TIES = {"lm_head.weight": "model.embed_tokens.weight"}


# -- AReaL --------------------------------------------------------------------------------
def _areal_engine(ckpt: str) -> Any:
    """AReaL's model build, ``parallelize_model`` and load (streamload's path entry: quicker,
    bit-exact), and a stand-in ``self`` with what ``FSDPEngine._save_model_to_hf`` reads, AReaL's
    own ``_compute_dtype`` / ``_cast_to_compute_dtype`` bound to it."""
    from areal.engine.fsdp_engine import FSDPEngine

    import streamload
    from streamload.tools.bench.clients import areal_model, areal_shard

    model, cfg, tc, helper = areal_model(ckpt, torch.float32, rank0_on_meta=True)
    areal_shard(model, cfg, tc, helper)
    streamload.areal_fsdp2_load_full_state_dict(
        model, ckpt if dist.get_rank() == 0 else {}, None, tie_word_embeddings=cfg.tie_word_embeddings
    )
    engine = SimpleNamespace(model=model, model_config=cfg, config=tc, cpu_group=None)
    engine._compute_dtype = FSDPEngine._compute_dtype.__get__(engine)
    engine._cast_to_compute_dtype = FSDPEngine._cast_to_compute_dtype.__get__(engine)
    return engine


def case_areal_hf(rank: int, world: int, *, ckpt: str, out: str, flip: bool = False) -> dict:
    """AReaL's ``FSDPEngine._save_model_to_hf`` (its own code) and streamload's
    ``save_model_to_hf`` on the same engine; rank 0 compares the two directories."""
    from areal.engine.fsdp_engine import FSDPEngine

    from streamload.integrations.areal_save import save_model_to_hf

    engine = _areal_engine(ckpt)
    tok = tiny_tokenizer(engine.model_config.vocab_size)
    a, b = os.path.join(out, "own"), os.path.join(out, "streamload")
    FSDPEngine._save_model_to_hf(engine, a, tok, None)
    save_model_to_hf(engine, b, tok, None)
    dist.barrier()
    if rank != 0:
        return {}
    res = compare_dirs(a, b, aliases=TIES)
    if flip:
        res["flipped"] = flip_check(a, b)
    return res


def case_verl_merge(rank: int, world: int, *, ckpt: str, out: str, flip: bool = False) -> dict:
    """verl's engine model saved by verl's ``FSDPCheckpointManager`` (``model`` content: the
    per-rank FSDP2 shards, plus rank 0's ``huggingface/`` config and tokenizer); then verl's own
    ``FSDPModelMerger.merge_and_save`` (one process, rank 0) and streamload's
    ``merge_fsdp_checkpoint`` on the run's ranks; rank 0 compares the two directories."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as VerlManager

    from streamload.integrations.verl_merge import merge_fsdp_checkpoint

    model = _verl_model(ckpt)
    tok = tiny_tokenizer(model.config.vocab_size)
    step = os.path.join(out, "step")
    _verl_manager(VerlManager, model, tok, ["model"]).save_checkpoint(step, global_step=1)
    a, b = os.path.join(out, "own"), os.path.join(out, "streamload")
    if rank == 0:
        cfg = ModelMergerConfig(
            operation="merge",
            backend="fsdp",
            local_dir=step,
            target_dir=a,
            hf_model_config_path=os.path.join(step, "huggingface"),
        )
        FSDPModelMerger(cfg).merge_and_save()
    dist.barrier()
    merge_fsdp_checkpoint(step, b)
    dist.barrier()
    if rank != 0:
        return {}
    res = compare_dirs(a, b)
    if flip:
        res["flipped"] = flip_check(a, b)
    return res
