"""How OpenVINO's static INT8 graph of an embedding model bends vectors, by calibration: the default (long texts
plus short spans of them) against the same texts without the spans, and with NNCF's SmoothQuant off.

Each graph is compared with ONNX Runtime FP32 on the same model: cosine mean / min over SST-2 dev sentences and
SciFact's test queries (short texts, where a graph calibrated on long ones bends most) and over the fidelity check's
texts (what ``--backend openvino-int8`` checks at load). Throughput is not measured here (bench/embed_peers.py).

    nice -n 5 python bench/int8_calibration.py                  # all-MiniLM-L6-v2, all variants
    python bench/int8_calibration.py --variants default,no-spans --sst 200
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np

from encoderkit import hardware
from encoderkit.hardware import describe
from encoderkit.inference import engines
from encoderkit.models.folder import ModelFolder
from encoderkit.models.names import resolve_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
VARIANTS = ("default", "no-spans", "smoothquant-off")


def texts(sst: int, queries: int) -> list[str]:
    rows = (DATA / "glue_sst2" / "dev.tsv").read_text(encoding="utf-8").split("\n")[1:]
    sentences = [r.split("\t")[0] for r in rows if r.strip()][:sst]
    with gzip.open(DATA / "scifact" / "topics.beir-v1.0.0-scifact.test.tsv.gz", "rt", encoding="utf-8") as f:
        qs = [line.split("\t", 1)[1] for line in f.read().split("\n") if "\t" in line][:queries]
    return sorted(sentences + qs, key=len)


def quantise(folder: ModelFolder, variant: str, out: Path) -> Path:
    """The plain graph quantised as engines.cached_openvino_int8 does, with ``variant``'s calibration/settings."""
    import nncf
    import openvino as ov
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    batches = engines.default_calibration(folder)
    if variant == "no-spans":  # the default's texts without their short spans (the calibration before them)
        spans = -(-engines.SHORT_SPANS // 8)
        batches = batches[:-spans]
    extra = {}
    if variant == "smoothquant-off":
        extra["advanced_parameters"] = AdvancedQuantizationParameters(
            smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1))
    plain = engines.cached_export(folder, False, plain=True)
    model = ov.Core().read_model(str(plain))
    names = {i.get_any_name() for i in model.inputs}
    data = nncf.Dataset([{k: v.astype(np.int64) for k, v in b.items() if k in names} for b in batches])
    nncf.set_log_level(logging.ERROR)
    with contextlib.redirect_stdout(sys.stderr):
        quantized = nncf.quantize(model, data, model_type=nncf.ModelType.TRANSFORMER,
                                  preset=nncf.QuantizationPreset.MIXED, subset_size=len(batches), **extra)
    ov.save_model(quantized, str(out / f"{variant}.xml"))
    return out / f"{variant}.xml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minilm", help="an embed folder or a known name (default: minilm)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--sst", type=int, default=872, help="SST-2 dev sentences")
    ap.add_argument("--queries", type=int, default=300, help="SciFact test queries")
    args = ap.parse_args()
    folder = ModelFolder.open(resolve_model(args.model))
    tok = folder.tokenizer()
    short = texts(args.sst, args.queries)
    batches = [dict(tok(short[i:i + 8], truncation=True, max_length=256, padding=True, return_tensors="np"))
               for i in range(0, len(short), 8)]
    reference = engines.OnnxEngine(engines.cached_export(folder, False, plain=True), folder.task, None)
    print(f"hardware: {describe()}", flush=True)
    print(f"{len(short)} short texts ({args.sst} SST-2 dev, {args.queries} SciFact queries); fidelity check: "
          f"{engines.CHECK_TEXTS}", flush=True)
    fields = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            engine = engines.OpenVinoEngine(quantise(folder, variant, Path(tmp)), folder.task, None)
            on_short = engines.fidelity(folder, engine, reference, batches)
            on_check = engines.fidelity(folder, engine, reference, engines.check_batches(folder))
            print(f"{variant:16s} short texts cos mean {on_short['mean']:.4f} min {on_short['min']:.4f} | "
                  f"check texts mean {on_check['mean']:.4f} min {on_check['min']:.4f} "
                  f"({'kept' if on_check['ok'] else 'refused'})", flush=True)
            key = variant.replace("-", "_")
            fields += [f"{key}_short_mean={on_short['mean']}", f"{key}_short_min={on_short['min']}",
                       f"{key}_check_mean={on_check['mean']}", f"{key}_check_min={on_check['min']}"]
    print("RESULT " + " ".join(fields) + f" {hardware.result_field()}")


if __name__ == "__main__":
    main()
