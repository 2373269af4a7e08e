"""benchmarks/gpu_check.sh without a GPU: its syntax, and its control flow and summary through a
stub interpreter (every step instant): a failing test does not stop the bench, the second test
run has the multi-rank switch on, missing dependencies are installed under a constraint that
pins the installed torch, and a dry run prints the same summary lines. (The real dry run takes
about a minute: its output is in the issue's note, not re-run here.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
LINE = re.compile(r"^gpu_check \| (\S+) +\| (PASS|FAIL|SKIP) +\| +\d+ s \| (.+)$")
STUB = r"""#!/usr/bin/env bash
echo "$* | force=${STREAMLOAD_FORCE_MULTI_RANK:-}" >>"$STUB_LOG"
if [ "$1" = "-" ]; then cat >/dev/null; echo "${STUB_MISSING:-}"; exit 0; fi
if [ "$1" = "-c" ]; then
    case "$2" in
        *cuda.is_available*) echo "torch 9.9 FakeGPU" ;;
        *__version__*) echo "9.9+cu999" ;;
    esac
    exit 0
fi
if [ "$1 $2" = "-m pytest" ]; then echo "3 passed in 0.01s"; exit "${STUB_PYTEST_RC:-0}"; fi
if [ "$1" = "benchmarks/bench_gpu.py" ]; then
    echo "streamload_owners              12.50 GB/s  (0.50x pinned H2D)"
    echo "pinned_h2d                     25.00 GB/s  (1.00x pinned H2D)"
    echo "reloads: nothing grew"
fi
exit 0
"""
GPU_CHECKS = ["cuda", "deps", "build", "gpu_tests", "gpu_tests_multi_rank", "bench", "total"]
DRY_CHECKS = ["cuda", "deps", "build", "world1_gloo", "fake_device", "nccl_refuses_cpu"]
DRY_CHECKS += ["gpu_tests", "gpu_tests_multi_rank", "bench", "total"]


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[int, dict[str, tuple[str, str]], list[str]]:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")
    full_env = {**os.environ, "PYTHON": str(stub), "STUB_LOG": str(log), **env}
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args, str(tmp_path / "out")],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = proc.stdout.split("== gpu_check summary", 1)[1].splitlines()[1:]
    lines = {}
    for text in summary:
        m = LINE.match(text)
        assert m, f"not a summary line: {text!r}\n{proc.stdout}"
        lines[m[1]] = (m[2], m[3])
    assert (tmp_path / "out" / "summary.txt").read_text().splitlines() == summary
    return proc.returncode, lines, log.read_text().splitlines()


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_a_failing_test_run_still_benches_and_fails_at_the_end(tmp_path: Path) -> None:
    rc, lines, calls = _run(tmp_path, STUB_PYTEST_RC="1")
    assert list(lines) == GPU_CHECKS, lines
    assert rc != 0
    assert lines["gpu_tests"][0] == lines["gpu_tests_multi_rank"][0] == "FAIL", lines
    assert lines["bench"] == (
        "PASS",
        "streamload_owners 12.50 GB/s, pinned_h2d 25.00 GB/s; reloads: nothing grew",
    )
    assert lines["total"][0] == "FAIL" and "gpu_tests gpu_tests_multi_rank" in lines["total"][1], lines
    pytest_calls = [c for c in calls if c.startswith("-m pytest")]
    assert [c.rsplit("force=", 1)[1] for c in pytest_calls] == ["", "1"], pytest_calls
    assert any(c.startswith("-m pip install -q --no-build-isolation --no-deps -e .") for c in calls), calls


def test_missing_dependencies_are_installed_without_touching_torch(tmp_path: Path) -> None:
    rc, lines, calls = _run(tmp_path, STUB_MISSING="pybind11>=2.12 pytest")
    assert rc == 0 and lines["total"][0] == "PASS", lines
    assert lines["deps"] == ("PASS", "installed pybind11>=2.12 pytest (torch 9.9+cu999 kept)"), lines
    install = [c for c in calls if c.startswith("-m pip install -q -c ")]
    assert len(install) == 1 and install[0].split(" | ")[0].endswith("pybind11>=2.12 pytest"), calls
    constraint = Path(install[0].split()[5])
    assert constraint.read_text().strip() == "torch==9.9+cu999"


@pytest.mark.parametrize("missing", ["", "pybind11>=2.12"])
def test_the_dry_run_prints_the_same_summary(tmp_path: Path, missing: str) -> None:
    rc, lines, calls = _run(tmp_path, "--dry-run", STUB_MISSING=missing)
    assert list(lines) == DRY_CHECKS, lines
    assert rc == 0 and lines["total"][0] == "PASS", lines
    assert lines["deps"][0] == ("SKIP" if missing else "PASS"), lines
    assert lines["bench"][0] == lines["gpu_tests"][0] == "SKIP", lines
    assert not any("pip" in c or "bench_gpu" in c for c in calls), calls  # nothing installed, no bench
    runs = [c.split(" | ")[0].split() for c in calls if c.startswith("-m pytest")]
    tests = [[a for a in run if a.startswith("tests/")] for run in runs]
    fake = ["tests/test_gpu_path.py", "tests/test_gpu_faults.py", "tests/test_host_shards.py"]
    fake += ["tests/test_nan_casts.py", "tests/test_missing_init.py"]
    assert tests == [["tests/test_world1_paths.py"], fake, ["tests/test_cpu_wire.py"]], calls
