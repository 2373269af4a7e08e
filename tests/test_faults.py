"""Fault injection with 3 ranks launched as separate processes: every rank
raises the named error within 30 s, no process is left running, and the
checkpoint is never written to.

Two tables: named faults (broken checkpoints, failures mid-stream), and a
failure injected into every step of the load, one rank at a time, in each
reader mode. The steps are read from the loader's own source (every function
its drivers call by name, plus the pipeline's methods), so a step added to the
loader joins the table or fails ``test_step_table_is_complete``."""

from __future__ import annotations

import ast
import builtins
import collections
import dataclasses
import enum
import hashlib
import importlib
import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path, PurePath

import pytest
from safetensors.torch import load_file, save_file

from streamload.tools.synthetic import make_checkpoint

HERE = Path(__file__).parent
WORLD = 3

# fault -> (class raised by the failing rank, class raised by the others, failing rank)
EXPECTED = {
    "truncated_shard": ("HeaderError", "HeaderError", 0),
    "corrupt_header": ("HeaderError", "HeaderError", 0),
    "header_len_beyond_file": ("HeaderError", "HeaderError", 0),
    "missing_tensor": ("KeyMismatchError", "KeyMismatchError", None),
    "wrong_shape_in_config": ("ShapeMismatchError", "ShapeMismatchError", None),
    "index_path_escape": ("UnsafePathError", "UnsafePathError", 0),
    "missing_shard": ("CheckpointFileError", "CheckpointFileError", 0),
    "src_raise_bucket": ("CheckpointFileError", "CheckpointFileError", 0),
    "src_interrupt": ("KeyboardInterrupt", "RemoteRankError", 0),
    "receiver_raise": ("RuntimeError", "RemoteRankError", 2),
    "truncated_while_loading": ("CheckpointFileError", "CheckpointFileError", 0),
    # readers="owners": every rank reads; the same protocol brings one rank's failure to all.
    "owners_raise_bucket": ("CheckpointFileError", "CheckpointFileError", 1),
    "owners_interrupt": ("KeyboardInterrupt", "RemoteRankError", 1),
    "owners_mismatched_copy": ("CheckpointFileError", "CheckpointFileError", None),
    # Steps after the placement all-gather and before the first weight byte:
    # a failure on one rank there raises on every rank instead of leaving the others in bucket 0.
    "plan_raise": ("RuntimeError", "RemoteRankError", 1),
    "map_raise": ("CheckpointFileError", "CheckpointFileError", 2),
}


def _sha(path: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def _make_cases(root: Path) -> dict[str, Path]:
    base = make_checkpoint(
        root / "base",
        "qwen2",
        tie=True,
        seed=31,
        layers=2,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_shard_size="8KB",
    )
    cases = {}
    for fault in EXPECTED:
        d = root / fault
        shutil.copytree(base, d)
        cases[fault] = d
    f = _shards(cases["truncated_shard"])[1]
    os.truncate(f, f.stat().st_size - 100)
    f = _shards(cases["corrupt_header"])[0]
    data = bytearray(f.read_bytes())
    data[8:24] = b'{"x": {{{{{{{{{{'
    f.write_bytes(bytes(data))
    _shards(cases["missing_shard"])[1].unlink()  # an interrupted download
    f = _shards(cases["header_len_beyond_file"])[0]
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", len(data) + 4096)
    f.write_bytes(bytes(data))
    d = cases["missing_tensor"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = index["weight_map"].pop("model.norm.weight")
    sd = load_file(str(d / victim))
    sd.pop("model.norm.weight")
    save_file(sd, str(d / victim), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((cases["wrong_shape_in_config"] / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (cases["wrong_shape_in_config"] / "config.json").write_text(json.dumps(cfg))
    other = root / "owners_mismatched_copy_other"  # rank 2's copy: same names, other header
    shutil.copytree(cases["owners_mismatched_copy"], other)
    f = _shards(other)[0]
    save_file(load_file(str(f)), str(f), metadata={"format": "pt", "copy": "other"})
    d = cases["index_path_escape"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../base/" + index["weight_map"][first]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return cases


# -- the step table -------------------------------------------------------------------------------
# Where the loader's steps are read from: each module's drivers, and the module's own functions
# they call (followed, and injected too). Every function they call by name is a step.
STEP_SOURCES = {
    "streamload.integrations.pretrained": ["from_pretrained"],
    "streamload.load.driver": ["run_load"],
    "streamload.load.source": ["open_source"],
    "streamload.load.prepare": ["prepare"],
    "streamload.transport.readers": ["choose"],
    "streamload.transport.stream": ["scatter", "read_owned"],
    "streamload.load.finalize": ["finalize"],
}
# The pipeline's steps that are methods (called on objects, not by name).
METHODS = [
    "streamload.transport.pack:Packer.pack",
    "streamload.transport.pack:Packer.check_source",
    "streamload.transport.pack:Packer.drain",
    "streamload.transport.collectives:Transport.start",
    "streamload.transport.collectives:Transport.wait",
    "streamload.transport.strategies:_Routed.open",
    "streamload.transport.protocol:StatusRoute.close",
]

# The collectives themselves: a rank that skips one leaves the others in it whatever the
# code around it does (a transport failure). Their local steps are in the table instead.
AGREEMENTS = {
    # The arrival: every rank meets its peers in the store before the first collective (with a
    # deadline; tests/test_arrival.py); a failure inside it is raised by the meeting's exit.
    "streamload.integrations.pretrained:meeting",
    "streamload.integrations.pretrained:gather_or_raise",
    "streamload.integrations.pretrained:open_source",
    "streamload.load.source:broadcast_object",
    "streamload.load.prepare:open_source",
    "streamload.load.prepare:choose",
    "streamload.load.prepare:gather_or_raise",
    "streamload.load.prepare:agree_ties",
    "streamload.transport.readers:gather_or_raise",
    "streamload.transport.stream:gather_or_raise",
    "streamload.transport.stream:_agree_on_buffers",
    "streamload.load.finalize:gather_or_raise",
}

# Steps with no failure to agree on, each with why.
EXEMPT = {
    # They pick the group and device every agreement runs on: there is nothing to agree with yet.
    "streamload.integrations.pretrained:resolve_group": "picks the group the agreements run on",
    "streamload.integrations.pretrained:resolve_device": "picks the device the agreements run on",
    "streamload.load.prepare:resolve_group": "picks the group the agreements run on",
    "streamload.load.prepare:resolve_device": "picks the device the agreements run on",
    "streamload.load.driver:resolve_group": "picks the group the load runs over",
    "streamload.load.driver:resolve_device": "picks the device the load's wire is decided from",
    # A CPU model over an NCCL-only group: the gloo twin is made (new_group, every rank) or the
    # load refused, the same on every rank from the same group (tests/test_cpu_wire.py).
    "streamload.load.driver:open_wire_route": "makes the gloo twin or refuses alike on every rank",
    "streamload.load.driver:close_route": "destroys the twin after the last agreement; a failure is a warning",
    "streamload.load.driver:replace": "dataclasses.replace of the options: no I/O",
    # The group-of-one decision (the group's size and a switch read once): the same on every rank.
    "streamload.transport.readers:solo": "a pure function of the group's size: the same on every rank",
    # Drivers: their steps are in the table (a failure at their entry is their first step's).
    "streamload.integrations.pretrained:run_load": "driver: its steps are in the table",
    "streamload.integrations.pretrained:_from_pretrained": "driver: its steps are in the table",
    "streamload.load.driver:prepare": "driver: its steps are in the table",
    "streamload.load.driver:finalize": "driver: its steps are in the table",
    "streamload.transport.stream:_stream": "the pipeline: its steps are in the table",
    # Bookkeeping without I/O, the same on every rank.
    "streamload.load.driver:recording": "timeline bookkeeping: no I/O",
    "streamload.load.driver:PhaseClock": "timing bookkeeping: no I/O",
    "streamload.integrations.pretrained:PhaseClock": "timing bookkeeping: no I/O",
    "streamload.load.source:nullcontext": "a no-op context (the phase clock's stand-in): no I/O",
    "streamload.load.driver:current": "timeline bookkeeping: no I/O",
    "streamload.transport.stream:current": "timeline bookkeeping: no I/O",
    "streamload.load.prepare:PhaseClock": "a clock: no I/O",
    "streamload.load.prepare:make_strategy": "picks a class from the agreed choice: no I/O",
    "streamload.load.prepare:fall_back": "a pure function of agreed values (the same on every rank)",
    "streamload.load.prepare:pad_buckets": "after the last agreement, appends empty buckets: no I/O",
    "streamload.integrations.pretrained:hf_missing": "builds the error a missing dependency raises everywhere",
    # Total functions of the caller's arguments (tests/test_remote.py: never raises, whatever it
    # is given); a bad storage_options fails where the store opens, inside the open agreement.
    "streamload.integrations.pretrained:as_remote": "wraps an object store URL: never raises",
    "streamload.load.prepare:as_remote": "wraps an object store URL: never raises",
    # Failures made local and harmless: after the last agreement, advisory.
    "streamload.load.finalize:_drop_cache": "advisory eviction wrapper (its evict is in the table)",
    "streamload.transport.stream:_close_quietly": "gives buffers back; a failure is a warning",
    "streamload.transport.stream:_drain_quietly": "waits for reads in flight; a failure is a warning",
    # Error paths only: re-raises a lost peer's transport error (tests/test_arrival.py kills ranks).
    "streamload.transport.stream:raise_if_lost": "re-raises a transport error that names a lost peer",
}

# Steps whose failure is harmless by design: the load succeeds on every rank.
ADVISORY = {
    "streamload.load.finalize:evict": "page-cache eviction after the last agreement: logged",
    "streamload.transport.stream:prefault": "faulting pages in early: pages fault in at first write instead",
    "streamload.transport.pack:Packer.drain": "cleanup after the last agreement: a warning",
    "streamload.transport.protocol:StatusRoute.close": "after the last agreement: a group left behind, a warning",
}

# Steps this run's checkpoint and options never reach, each with why.
NOT_REACHED = {
    "streamload.load.prepare:materialize_offloaded": "no CPU offload policy",
    "streamload.load.prepare:check_kept": "quantized='keep' only",
    "streamload.load.prepare:plan_mapping": "mapping= only (torchtitan)",
    "streamload.integrations.pretrained:keep_quantized_skeleton": "quantized='keep' only",
    "streamload.load.finalize:evict": "drop_cache only (tests/test_agreements.py injects it)",
    "streamload.load.prepare:default_bucket_bytes": "bucket_bytes is given",
    "streamload.load.prepare:key_mismatch_hint": "only when keys mismatch (the error's message)",
    "streamload.load.prepare:key_mismatch_reason": "only when keys mismatch (the error's message)",
    "streamload.load.source:portable": "only on the reader's failure (makes the error picklable)",
    "streamload.transport.readers:_first_difference": "only when a copy differs (the error's message)",
    # Object storage only (this run's checkpoint is on disk): tests/test_remote_dist.py fails its
    # requests on one rank (a proxy in front of the endpoint) and checks every rank's error.
    "streamload.integrations.pretrained:_read_remote_configs": "a checkpoint in object storage only",
    "streamload.integrations.pretrained:read_small": "a checkpoint in object storage only",
    "streamload.load.source:identity_soon": "a checkpoint in object storage only",
    "streamload.transport.readers:opened_remote_identity": "a checkpoint in object storage only",
    "streamload.load.prepare:opened_identity": "a checkpoint in object storage only (meta.objects)",
    "streamload.transport.readers:remote_identity": "a checkpoint in object storage only",
    "streamload.transport.stream:open_status_route": "every strategy passes the route it opened",
    "streamload.transport.stream:split_direct": "a device owners load with CPU-offloaded shards only "
    "(tests/test_host_shards.py)",
}

MODES = ("src", "owners", "node")


def _called_names(module: str, roots: list[str]) -> set[str]:
    """Module globals that ``roots`` (functions of ``module``) call by name, following the
    module's own functions; builtins and exception classes are left out."""
    mod = importlib.import_module(module)
    tree = ast.parse(inspect.getsource(mod))
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    seen, todo, names = set(), list(roots), set()
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for node in ast.walk(funcs[fn]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
                obj = vars(mod).get(name)
                if obj is None or hasattr(builtins, name):
                    continue
                if isinstance(obj, type) and issubclass(obj, BaseException):
                    continue
                names.add(name)
                if name in funcs:
                    todo.append(name)
    return names


def loader_steps() -> list[str]:
    """Every step of the load, as ``module:name`` (or ``module:Class.method``)."""
    out = {f"{m}:{n}" for m, roots in STEP_SOURCES.items() for n in _called_names(m, roots)}
    return sorted(out | set(METHODS))


def is_record(step: str) -> bool:
    """A constructor that only stores its arguments: a dataclass without ``__post_init__``,
    an enum, a deque or a path (no I/O: nothing to fail on one rank)."""
    module, _, name = step.partition(":")
    obj = getattr(importlib.import_module(module), name, None)
    if not isinstance(obj, type):
        return False
    if dataclasses.is_dataclass(obj):
        return not hasattr(obj, "__post_init__")
    return issubclass(obj, (enum.Enum, collections.deque, PurePath))


def injected_steps() -> list[str]:
    """The steps a failure is injected into: all but the agreements, the exempt and the records."""
    return [s for s in loader_steps() if s not in AGREEMENTS and s not in EXEMPT and not is_record(s)]


# Steps only the reader (rank 0) runs outside src mode: they fail there in every mode.
ON_READER = {
    "streamload.transport.readers:opened_identity": "the reader's proof of the files it holds open",
}


def _fail_ranks(i: int, mode: str, step: str = "") -> list[int]:
    """The ranks a step fails on, one per load: in src mode the reader and a receiver, else one
    rank, rotating with the step's index so that each step fails on several ranks (the reader
    for a step only it runs)."""
    if step in ON_READER and mode != "src":
        return [0]
    if mode == "src":
        return [0, 1 + i % 2]
    return [(i + MODES.index(mode)) % WORLD]


# Pipeline steps called once per bucket: they also fail at their third call (bucket 2 or so,
# with buckets in flight), not only at the first.
PER_BUCKET = {
    "streamload.transport.pack:Packer.pack",
    "streamload.transport.collectives:Transport.start",
    "streamload.transport.collectives:Transport.wait",
    "streamload.transport.stream:unpack",
}


def _injections(i: int, step: str) -> list[tuple[str, int, int]]:
    """(reader mode, failing rank, failing call) for step number ``i``."""
    out = [(mode, r, 1) for mode in MODES for r in _fail_ranks(i, mode, step)]
    if step in PER_BUCKET:
        out += [(mode, r, 3) for mode in ("src", "node") for r in _fail_ranks(i + 1, mode)]
    return out


def _step_cases(ckpt: Path) -> list[dict]:
    cases = []
    for i, step in enumerate(injected_steps()):
        for mode, r, at in _injections(i, step):
            cases.append(
                {
                    "id": f"{step}|{mode}|{r}|{at}",
                    "step": step,
                    "readers": mode,
                    "fail_rank": r,
                    "at": at,
                    "ckpt": str(ckpt),
                }
            )
    return cases


def _launch(
    root: Path, cases: list[dict], budget_s: float
) -> tuple[dict[str, dict[int, dict]], list, list[str]]:
    """Runs ``cases`` on WORLD worker processes; returns rows by case id and rank, the
    processes and their logs. A rank that hangs ends itself (fault_worker's deadline)."""
    spec = root / "cases.json"
    spec.write_text(json.dumps(cases))
    init = tempfile.mktemp(prefix="streamload_faults_pg_")
    outs = [root / f"rank{r}.jsonl" for r in range(WORLD)]
    logs = [root / f"rank{r}.log" for r in range(WORLD)]
    procs = []
    for r in range(WORLD):
        with open(logs[r], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "fault_worker.py"), "--rank", str(r), "--world", str(WORLD),
                     "--init", init, "--cases", str(spec), "--out", str(outs[r])],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )  # fmt: skip
    deadline = time.monotonic() + budget_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                pytest.fail(f"fault run did not finish within {budget_s} s")
            if any(p.poll() not in (None, 0) for p in procs):
                # One rank ended on a hang: the others end at their own deadline; wait for it.
                deadline = min(deadline, time.monotonic() + 60)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if os.path.exists(init):
            os.unlink(init)
    rows: dict[str, dict[int, dict]] = {}
    for out in outs:
        if out.exists():
            for line in out.read_text().splitlines():
                row = json.loads(line)
                rows.setdefault(row["id"], {})[row["rank"]] = row
    return rows, procs, [log.read_text(errors="replace")[-4000:] for log in logs]


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("faults")
    cases = _make_cases(root)
    before = {f: _sha(d) for f, d in cases.items()}
    spec = [{"id": "warm-up", "ckpt": str(root / "base")}]  # a plain load first: imports, first calls
    spec += [{"id": f, "fault": f, "ckpt": str(d)} for f, d in cases.items()]
    spec += _step_cases(root / "base")
    rows, procs, logs = _launch(root, spec, budget_s=1500)
    after = {f: _sha(d) for f, d in cases.items()}
    return {"rows": rows, "procs": procs, "logs": logs, "before": before, "after": after}


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_every_rank_raises_named_error(fault_run, fault: str) -> None:
    rows = fault_run["rows"].get(fault)
    assert rows and sorted(rows) == list(range(WORLD)), (fault, fault_run["logs"])
    own, others, failing = EXPECTED[fault]
    for rank, row in rows.items():
        want = own if failing is None or rank == failing else others
        assert row["raised"] == want, (fault, rank, row)
        assert row["seconds"] < 30, (fault, rank, row["seconds"])
        if failing is not None and row["raised"] not in ("RuntimeError", "KeyboardInterrupt"):
            # Named errors carry the failing rank (its own re-raised exception need not).
            assert row["error_rank"] == failing, (fault, rank, row)
    if fault in (
        "truncated_shard",
        "corrupt_header",
        "header_len_beyond_file",
        "index_path_escape",
        "missing_shard",
    ):
        assert all(row["file"] and fault in row["file"] for row in rows.values()), rows
    if fault == "missing_tensor":
        assert "model.norm.weight" in rows[1]["message"]
        assert all("hint: pass strict=False" in row["message"] for row in rows.values()), rows
    if fault == "missing_shard":  # the reader's error, hint included, pickled to the others
        assert all("hint: the download is incomplete" in row["message"] for row in rows.values()), rows
        assert all(row["message"] == rows[0]["message"] for row in rows.values()), rows
    if fault == "owners_mismatched_copy":
        assert all("ranks [2] do not see the same files" in row["message"] for row in rows.values()), rows
        assert all(row["file"].endswith(".safetensors") for row in rows.values()), rows
    if fault == "wrong_shape_in_config":
        assert all(row["tensor"] and "mlp" in row["tensor"] for row in rows.values()), rows
        assert all("own config.json" in row["message"] for row in rows.values()), rows


@pytest.mark.parametrize("step", injected_steps())
def test_step_failure_raises_on_every_rank(fault_run, step: str) -> None:
    """A failure in ``step`` on one rank (its first call, or its third for a per-bucket
    step): that rank raises it and every other rank raises a
    RemoteRankError naming that rank, within 30 s; or, for an advisory step (or one the
    load does not reach), every rank succeeds."""
    i = injected_steps().index(step)
    for mode, fail, at in _injections(i, step):
        case = f"{step}|{mode}|{fail}|{at}"
        rows = fault_run["rows"].get(case, {})
        assert sorted(rows) == list(range(WORLD)), (case, rows, fault_run["logs"])
        for rank, row in rows.items():
            assert row["raised"] != "HANG", (case, rank, row)
            assert row["seconds"] < 30, (case, rank, row["seconds"])
        fired = rows[fail]["fired"] > 0
        if not fired or step in ADVISORY:
            assert all(row["raised"] is None for row in rows.values()), (case, rows)
            continue
        for rank, row in rows.items():
            if rank == fail:
                assert row["raised"] == "InjectedFault", (case, rank, row)
            else:
                assert row["raised"] == "RemoteRankError", (case, rank, row)
                assert row["error_rank"] == fail and "injected failure" in row["message"], (
                    case,
                    rank,
                    row,
                )


def test_step_table_is_complete(fault_run) -> None:
    """The table is the loader's steps: every step read from its source is injected, an
    agreement or exempt (with a reason); each injected step ran in some mode, unless listed
    as not reached (and then it never ran)."""
    steps = set(loader_steps())
    assert AGREEMENTS <= steps, sorted(AGREEMENTS - steps)  # stale names fail here
    assert set(EXEMPT) <= steps, sorted(set(EXEMPT) - steps)
    assert set(ADVISORY) <= steps and set(NOT_REACHED) <= steps
    fired: dict[str, bool] = {}
    for case, rows in fault_run["rows"].items():
        if "|" in case:
            step = case.split("|")[0]
            fired[step] = fired.get(step, False) or any(r["fired"] > 0 for r in rows.values())
    ran_anyway = [s for s in injected_steps() if s in NOT_REACHED and fired.get(s)]
    never = [s for s in injected_steps() if s not in NOT_REACHED and not fired.get(s)]
    assert not ran_anyway, f"these ran: take them off NOT_REACHED: {ran_anyway}"
    assert not never, f"these never ran in any mode: {never}"


def test_no_process_left_and_checkpoints_unchanged(fault_run) -> None:
    assert all(p.returncode == 0 for p in fault_run["procs"]), fault_run["logs"]
    assert all(p.poll() is not None for p in fault_run["procs"])
    for fault, sums in fault_run["before"].items():
        if fault == "truncated_while_loading":
            continue  # the test itself truncates this copy mid-load
        assert fault_run["after"][fault] == sums, fault
