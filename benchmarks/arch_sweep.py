"""The architecture sweep as a report: every causal-LM model type the
installed transformers registers, shrunk, saved with save_pretrained and
loaded by streamload at 2 gloo ranks, compared bit for bit with transformers'
from_pretrained. Writes docs/architectures.md (counts, then every skipped or
failed architecture with its reason).

    python benchmarks/arch_sweep.py --out docs/architectures.md [--only llama gpt2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import conftest  # noqa: E402,F401 - the tests' environment (threads, offline hub)
from arch_sweep import Outcome, summary, sweep  # noqa: E402

from streamload.tools.archs import causal_lm_types  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/architectures.md")
    ap.add_argument(
        "--jsonl", default="bench_out/arch_sweep.jsonl", help="one line per architecture, as it ends"
    )
    ap.add_argument("--only", nargs="*", help="these model types only")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    args = ap.parse_args()
    import transformers

    types = args.only or causal_lm_types()
    Path(args.jsonl).parent.mkdir(parents=True, exist_ok=True)
    with open(args.jsonl, "w") as log, tempfile.TemporaryDirectory() as tmp:

        def record(o: Outcome) -> None:
            log.write(json.dumps(o.__dict__) + "\n")
            log.flush()
            print(f"{o.model_type}: {o.status} {o.reason[:160]}", flush=True)

        outcomes = sweep(types, Path(tmp), timeout=args.timeout, on_result=record)
    head = (
        "# Architectures\n\n"
        f"`python benchmarks/arch_sweep.py` with transformers {transformers.__version__}: every model type in "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, its default config shrunk generically "
        "(`streamload.tools.archs.shrink_config`: 2 layers, hidden 32, 4 heads, vocab 128, ...), random "
        "bfloat16 weights saved with `save_pretrained`, transformers' own round trip checked first, then "
        "`streamload.from_pretrained` at 2 gloo ranks (files on rank 0 only) compared with transformers' "
        "`from_pretrained`: every parameter's `full_tensor()` and every buffer bit for bit, alias groups "
        "equal on both ranks.\n\n"
    )
    Path(args.out).write_text(head + summary(outcomes))
    print(summary(outcomes).splitlines()[0])


if __name__ == "__main__":
    main()
