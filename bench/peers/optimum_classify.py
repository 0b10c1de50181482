"""optimum's ORTModelForSequenceClassification on a classify folder, in its own process and virtual environment
(optimum[onnxruntime] pins an older transformers than encoderkit's), for bench/classify_speed.py.

    /work/venvs/optimum/bin/python bench/peers/optimum_classify.py --model DIR --texts texts.json --work DIR \\
        --threads 2 --batch 32 --max-length 512 --int8 avx512_vnni

It imports nothing of encoderkit. Two engines, each timed on the same texts (a JSON list) after a warm-up:

* ``fp32``: ``ORTModelForSequenceClassification.from_pretrained(model, export=True)``, optimum's own ONNX export
  run by ONNX Runtime;
* ``int8``: that graph through ``ORTQuantizer`` with ``AutoQuantizationConfig.<isa>(is_static=False,
  per_channel=True)`` (dynamic INT8 for this CPU's instruction set: ``avx512_vnni`` or ``avx2``; ``--int8 none``
  skips it).

Texts go in batches of ``--batch`` in the order given, each padded to its longest text (what optimum's examples
do: a tokenizer call and ``model(**inputs).logits``). One JSON object on stdout:
``{"fp32": {"per_s", "seconds", "labels"}, "int8": {...}, "versions": {...}}``; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def session_options(threads: int | None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    return so


def timed(model, tokenizer, texts: list[str], batch: int, max_length: int) -> dict:
    """texts/s of labelling ``texts`` (after a warm-up on the first batch), and the labels."""
    import numpy as np

    def labels(chunk: list[str]) -> list[str]:
        enc = tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="np")
        logits = np.asarray(model(**enc).logits)
        return [model.config.id2label[int(i)] for i in logits.argmax(-1)]

    labels(texts[:batch])
    t0 = time.perf_counter()
    out = [lab for i in range(0, len(texts), batch) for lab in labels(texts[i:i + batch])]
    seconds = time.perf_counter() - t0
    return {"per_s": len(texts) / seconds, "seconds": seconds, "labels": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--texts", required=True, help="JSON list of texts")
    ap.add_argument("--work", required=True, help="a folder for the exported and quantised graphs")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--int8", default="avx512_vnni", choices=("avx512_vnni", "avx2", "none"))
    args = ap.parse_args()

    import importlib.metadata as md

    from optimum.onnxruntime import ORTModelForSequenceClassification, ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig
    from transformers import AutoTokenizer

    texts = json.loads(Path(args.texts).read_text(encoding="utf-8"))
    work = Path(args.work)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    so = session_options(args.threads or None)
    t0 = time.perf_counter()
    fp32 = ORTModelForSequenceClassification.from_pretrained(args.model, export=True, session_options=so)
    fp32.save_pretrained(work / "fp32")
    print(f"optimum: exported in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    result = {"fp32": timed(fp32, tokenizer, texts, args.batch, args.max_length)}
    if args.int8 != "none":
        quantizer = ORTQuantizer.from_pretrained(work / "fp32")
        qconfig = getattr(AutoQuantizationConfig, args.int8)(is_static=False, per_channel=True)
        quantizer.quantize(save_dir=work / "int8", quantization_config=qconfig)
        name = next(p.name for p in (work / "int8").glob("*.onnx"))
        int8 = ORTModelForSequenceClassification.from_pretrained(work / "int8", file_name=name, session_options=so)
        result["int8"] = timed(int8, tokenizer, texts, args.batch, args.max_length) | {"isa": args.int8}
    result["versions"] = {n: md.version(n) for n in ("optimum", "optimum-onnx", "onnxruntime", "transformers", "torch")
                          if _installed(md, n)}
    print(json.dumps(result))
    return 0


def _installed(md, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
