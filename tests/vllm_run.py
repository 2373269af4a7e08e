"""Runs the weight-sync cases in the vLLM venv; started by test_sync_vllm.py with that venv's
interpreter. streamload comes from the repository (its root on sys.path) and its native
extension from the main venv's build (STREAMLOAD_NATIVE: the torch-free .so, loaded by path, so
the vLLM venv needs no compiler). Writes the results as a pickle to argv[1]."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def boot() -> None:
    """Makes the repository's streamload importable with the prebuilt extension."""
    so = os.environ.get("STREAMLOAD_NATIVE")
    if so:
        spec = importlib.util.spec_from_file_location("streamload._streamload", so)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["streamload._streamload"] = mod
    for p in (ROOT, os.path.join(ROOT, "tests")):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])


# At import: the rank processes (spawned) import this module as their __main__ too.
boot()

MODELS = {
    # MoE first: vLLM makes its expert-parallel group only when the first engine of a process is MoE
    "moe": (
        "qwen3_moe",
        dict(tie=True, head_dim=64, num_experts=4, moe_intermediate_size=32, intermediate_size=64),
    ),
    "dense_tied": ("qwen2", dict(tie=True, intermediate_size=64)),
    "dense_untied": ("llama", dict(tie=False, intermediate_size=64)),
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    import json
    import subprocess

    import torch
    import vllm_cases as cases
    from rank_group import RankGroup

    from streamload.tools.synthetic import make_checkpoint

    world = int(os.environ.get("SYNC_WORLD", "2"))
    root = tempfile.mkdtemp(prefix="streamload_vllm_")
    ckpts = {
        key: str(make_checkpoint(os.path.join(root, key), mt, dtype=torch.float32, seed=7 + i, hidden_size=128,
                                 num_attention_heads=2, num_key_value_heads=1, layers=2, vocab=256, **kw))
        for i, (key, (mt, kw)) in enumerate(MODELS.items())
    }  # fmt: skip
    results: dict[str, object] = {}
    t0 = time.perf_counter()
    # The separate engine (fed by every trainer rank, at 2 and at 3): its process starts now and
    # loads its engines while the colocated cases run.
    ports = {key: _free_port() for key in MODELS}
    engine: subprocess.Popen[bytes] | None = None
    if world > 1:
        engine = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--engine",
                json.dumps(ckpts),
                json.dumps(ports),
                str(world),
            ]
        )
    g = RankGroup(world)
    try:
        for key in MODELS:
            results[key] = g.run(
                cases.case_colocated, timeout=300, ckpt=ckpts[key], out=os.path.join(root, f"out_{key}"),
                key=key, moe=key == "moe",
            )  # fmt: skip
        results["partition"] = g.run(cases.case_group_partition, key="moe")
        results["errors"] = g.run(cases.case_errors, timeout=120, dense="dense_tied", other="dense_untied")
        if engine is not None:
            import vllm_separate

            t1 = time.perf_counter()
            results["separate"] = g.run(
                vllm_separate.case_separate, timeout=240, ports=ports, engine_pid=engine.pid
            )
            results["separate_seconds"] = time.perf_counter() - t1
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
        if engine is not None:
            engine.wait(timeout=30)
        results["seconds"] = time.perf_counter() - t0
        with open(sys.argv[1], "wb") as f:
            pickle.dump(results, f)
        g.close(kill=True)  # the engines' exit hooks would tear down the group under each other


if __name__ == "__main__":
    if sys.argv[1] == "--engine":
        import json

        import vllm_separate

        vllm_separate.engine_main(json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
