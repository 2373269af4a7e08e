"""map_files="auto" maps frozen weights only from checkpoint files this process cannot write:
a save into the directory the model was loaded from (``save_pretrained`` truncates and
rewrites its files) would otherwise change the mapped weights or unmap them (SIGBUS).

Each load runs in a child process: as root, write permission is a capability, so the child
drops CAP_DAC_OVERRIDE (``setpriv``) and a chmod'ed file is then read-only for it as for
any other user."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from streamload.tools.synthetic import make_checkpoint

CHILD = r"""
import json, sys, torch, streamload
from transformers import AutoConfig, AutoModelForCausalLM
ckpt, map_files = sys.argv[1], sys.argv[2]
map_files = {"True": True, "False": False}.get(map_files, map_files)
config = AutoConfig.from_pretrained(ckpt)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
model.requires_grad_(False)  # frozen: what "auto" maps
rep = streamload.load_checkpoint(model, ckpt, progress=False, map_files=map_files)
ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=config.dtype)
exact = all(torch.equal(p, ref.state_dict()[n]) for n, p in model.state_dict().items() if n in ref.state_dict())
print(json.dumps({"mapped": rep.bytes_mapped, "payload": rep.payload_bytes, "exact": exact}))
"""


def _prefix() -> list[str]:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a file read-only for this process")
    return [setpriv, "--inh-caps=-dac_override", "--bounding-set=-dac_override"]


def _load(ckpt: Path, map_files: str) -> dict:
    proc = subprocess.run(
        [*_prefix(), sys.executable, "-c", CHILD, str(ckpt), map_files],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mapped_writable")
    src = make_checkpoint(
        root / "src",
        "qwen2",
        seed=7,
        num_hidden_layers=1,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    writable, readonly = root / "writable", root / "readonly"
    shutil.copytree(src, writable)
    shutil.copytree(src, readonly)
    for f in readonly.glob("*.safetensors"):
        f.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    yield writable, readonly
    for f in readonly.glob("*.safetensors"):
        f.chmod(stat.S_IRUSR | stat.S_IWUSR)


def test_auto_maps_read_only_files_and_copies_writable_ones(copies: tuple[Path, Path]) -> None:
    writable, readonly = copies
    ro = _load(readonly, "auto")
    assert ro["exact"] and ro["mapped"] > ro["payload"] // 2, ro  # frozen weights: views of the files
    rw = _load(writable, "auto")
    assert rw["exact"] and rw["mapped"] == 0, rw  # a later save_pretrained here must not reach them
    forced = _load(writable, "True")
    assert forced["exact"] and forced["mapped"] == ro["mapped"], forced  # map_files=True: the caller's call
