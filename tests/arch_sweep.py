"""The architecture sweep's runner, shared by tests/test_arch_sweep.py and
benchmarks/arch_sweep.py: one 2-rank gloo group for every architecture, a
timeout per architecture (a hung group is killed and a fresh one started)."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cases_arch
from rank_group import CaseError, RankGroup

from streamload.tools.archs import Skip, build_checkpoint


@dataclass
class Outcome:
    """One architecture's result: loaded, failed (streamload's fault) or skipped."""

    model_type: str
    status: str
    reason: str = ""
    params: int = 0
    seconds: float = 0.0


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Bounds the parent's own work (building and saving one model)."""

    def fire(signum: int, frame: object) -> None:
        raise _Timeout(f"building the checkpoint took over {seconds:.0f}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _first_line(text: str, limit: int = 300) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # The exception line of the first failing rank's traceback says what went wrong.
    tail = next(
        (ln for ln in lines if ln.startswith(("streamload.", "AssertionError")) or "Error:" in ln), ""
    )
    return (tail or (lines[-1] if lines else text))[:limit]


def sweep(
    model_types: list[str],
    root: Path,
    ws: int = 2,
    timeout: float = 120.0,
    on_result: Callable[[Outcome], None] | None = None,
    group: RankGroup | None = None,
) -> list[Outcome]:
    """Builds, saves and loads each architecture at ``ws`` ranks; returns every outcome.

    ``group`` (at least ``ws`` ranks) is used and left open; without one, or
    once a hang has killed it, the sweep starts its own and closes it.
    """
    given = group
    out: list[Outcome] = []
    try:
        for mt in model_types:
            start = time.perf_counter()
            try:
                with _deadline(timeout):
                    built = build_checkpoint(mt, root / mt)
            except (Skip, _Timeout) as exc:
                res = Outcome(mt, "skipped", str(exc)[:300])
            else:
                if group is None:
                    group = RankGroup(ws)
                try:
                    ranks = group.run(cases_arch.case_arch, timeout=timeout, ckpt=str(built.path), ws=ws)
                except CaseError as exc:
                    if "did not finish" in str(exc):
                        group = None  # the harness killed the hung group
                    res = Outcome(mt, "failed", _first_line(str(exc)), built.params)
                else:
                    res = _judge(mt, ranks, built.params)
            res.seconds = time.perf_counter() - start
            out.append(res)
            if on_result is not None:
                on_result(res)
    finally:
        if group is not None and group is not given:
            group.close()
    return out


def _judge(mt: str, ranks: list[dict | None], params: int) -> Outcome:
    for r, res in enumerate(ranks):
        if res is None:
            continue
        if res["differ"]:
            return Outcome(mt, "failed", f"rank {r}: differs from transformers: {res['differ'][:4]}", params)
        if res["aliases"] != res["ref_aliases"]:
            return Outcome(
                mt,
                "failed",
                f"rank {r}: alias groups {res['aliases']} != transformers' {res['ref_aliases']}",
                params,
            )
    return Outcome(mt, "loaded", "", params)


def summary(outcomes: list[Outcome]) -> str:
    """A Markdown report: counts, then every skipped and failed architecture with its reason."""
    loaded = [o for o in outcomes if o.status == "loaded"]
    failed = [o for o in outcomes if o.status == "failed"]
    skipped = [o for o in outcomes if o.status == "skipped"]
    lines = [
        f"{len(loaded)} loaded bit-exact / {len(loaded) + len(failed)} attempted "
        f"({len(failed)} failed) / {len(skipped)} skipped, of {len(outcomes)} registered causal-LM model types.",
        "",
        "| model type | result | parameters | seconds | reason |",
        "|---|---|---|---|---|",
    ]
    for o in sorted(outcomes, key=lambda o: ({"failed": 0, "skipped": 2}.get(o.status, 1), o.model_type)):
        reason = o.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {o.model_type} | {o.status} | {o.params:,} | {o.seconds:.1f} | {reason} |")
    return "\n".join(lines) + "\n"
