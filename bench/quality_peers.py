"""Quality against what users would train with instead, task by task, on the same data and budget (issue 55).

Runs each task's bench (each runs encoderkit and its peer side by side, the peer in its own venv; their
docstrings say exactly what each side runs, what is shared and what time is counted), reads the rows each
writes (``--summary``) and prints one table and one RESULT line:

    classify     SST-2                      HF Trainer                     bench/quality_classify.py
    ner          CoNLL-2003                 HF Trainer + seqeval           bench/quality_ner.py
    qa           SQuAD v1.1                 HF Trainer, run_qa-style       bench/quality_qa.py
    embed        SciFact                    sentence-transformers (MNRL,   bench/quality_embed.py
                                            and with mined hard negatives)
    rerank       SciFact                    sentence-transformers'         bench/quality_rerank.py
                                            CrossEncoder trainer
    few-label    SST-2, SQuAD topics        SetFit                         bench/few_label.py
    multilabel   57-label questions,        HF Trainer (multi-label)       bench/quality_multilabel.py
                 CoNLL entity types

A row's verdict: ``ok`` when encoderkit's mean metric is at least the peer's, or below by no more than the seeds'
spread, in at most the peer's mean wall time; ``below`` or ``slower`` otherwise (bench/quality_common.py).

    nice -n 15 python bench/quality_peers.py                               # every task, each bench's defaults
    python bench/quality_peers.py --tasks ner,classify --seeds 0
    python bench/quality_peers.py --tasks ner --extra ner="--full"         # a bench's own flags
    python bench/quality_peers.py --from /tmp/quality                      # the table from summaries kept
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from quality_common import Row, print_rows, read_rows

from encoderkit.hardware import describe, result_field

BENCH = Path(__file__).resolve().parent
TASKS = {"classify": "quality_classify.py", "ner": "quality_ner.py", "qa": "quality_qa.py",
         "embed": "quality_embed.py", "rerank": "quality_rerank.py", "few-label": "few_label.py",
         "multilabel": "quality_multilabel.py"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    ap.add_argument("--seeds", default="0,1,2", help="every bench's seeds")
    ap.add_argument("--threads", type=int, default=1, help="each side's threads")
    ap.add_argument("--extra", action="append", default=[], metavar="TASK=FLAGS",
                    help="more flags for one task's bench, e.g. ner=\"--full\" (repeatable)")
    ap.add_argument("--keep", default="", help="folder to keep each task's summary in (default: a temporary one)")
    ap.add_argument("--from", dest="from_dir", default="",
                    help="no runs: the table from the summaries (TASK.json) in this folder")
    args = ap.parse_args(argv)
    print(f"hardware: {describe()}", flush=True)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}")
    extra = {}
    for item in args.extra:
        task, _, flags = item.partition("=")
        if task not in TASKS:
            raise SystemExit(f"--extra {item!r}: {task!r} is not a task ({', '.join(TASKS)})")
        extra[task] = shlex.split(flags)

    keep = Path(args.from_dir or args.keep or f"/tmp/quality_peers_{int(time.time())}")
    keep.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    failed = []
    for task in tasks:
        summary = keep / f"{task}.json"
        if not args.from_dir:
            cmd = [sys.executable, str(BENCH / TASKS[task]), "--summary", str(summary), "--threads",
                   str(args.threads), "--seeds", args.seeds, *extra.get(task, [])]
            print(f"\n## {task}: {shlex.join(cmd)}", flush=True)
            t0 = time.perf_counter()
            code = subprocess.run(cmd, check=False).returncode
            print(f"## {task}: exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
            if code != 0:
                failed.append(task)
                continue
        if summary.exists():
            rows.extend(read_rows(summary))
        else:
            failed.append(task)
    print(f"\n# {describe()}")
    print_rows(rows)
    for r in rows:
        if r.note:
            print(f"{r.task}, {r.data}: {r.note}")
    verdicts = [r.verdict() for r in rows]
    fields = [f for r in rows for f in r.fields()]
    print(f"RESULT bench=quality_peers rows={len(rows)} ok={verdicts.count('ok')} below={verdicts.count('below')} "
          f"slower={verdicts.count('slower')} failed={','.join(failed) or 'none'} {' '.join(fields)} "
          f"{result_field()}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
