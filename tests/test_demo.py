"""`streamload demo`, the README's first command, passes as written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def test_demo_command_passes() -> None:
    exe = shutil.which("streamload")
    cmd = [exe, "demo"] if exe else [sys.executable, "-m", "streamload.tools.cli", "demo"]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "demo passed" in r.stdout
    for strategy in ("streamload", "streamload_owners", "rank0_broadcast", "all_ranks"):
        assert f"| {strategy} |" in r.stdout
