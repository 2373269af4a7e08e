"""AReaL 1.0.4's own load (FSDPEngine, fsdp.memory_efficient_load) against streamload
swapped in, side by side: load time, peak anonymous memory per rank, bit-exact.

    python benchmarks/client_areal.py --gb 0.35 --ranks 2 4 --repeat 3

Rows: ``areal_own`` (rank 0 from_config + load_state_dict + state_dict, parallelize_model,
AReaL's set_model_state_dict broadcast), ``areal_streamload`` (the same with streamload's
AReaL entry at the call) and ``areal_streamload_path`` (every rank on meta, the checkpoint
path on rank 0). fp32 parameters: AReaL's optimizer_dtype.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _client_bench import run  # noqa: E402

if __name__ == "__main__":
    run("AReaL", ["areal_own", "areal_streamload", "areal_streamload_path"], "float32")
