"""accelerate's FSDP2 ``prepare`` with ``cpu_ram_efficient_loading`` against the same with
streamload's entry at its load call site, side by side: load time, peak anonymous memory
per rank, bit-exact.

    python benchmarks/client_accelerate.py --gb 0.35 --ranks 2 4 --repeat 3

Timed from ``from_pretrained`` (under the plugin) to the end of ``Accelerator.prepare``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _client_bench import run  # noqa: E402

if __name__ == "__main__":
    run("accelerate", ["accelerate_own", "accelerate_streamload"], "bfloat16")
