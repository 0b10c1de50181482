"""4-bit word embeddings inside an ONNX graph (ONNX Runtime's ``GatherBlockQuantized``).

The word-embedding matrix is a large share of a small encoder, and ORT's dynamic quantization stores it as
per-tensor uint8. This swaps the fp32 export's ``Gather(word_embeddings, input_ids)`` for packed uint4 blocks with
an fp16 scale and a uint4 zero point each, dequantized for the looked-up rows only. Run it before
``quantize_dynamic``, which leaves the new node alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from encoderkit.compress.packing import QuantSpec, pack_int4, rtn_quantize
from encoderkit.errors import EncoderkitError

BLOCK_SIZES = (16, 32, 64, 128, 256)


def uint4_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 in 0..15, scales fp16, zero points uint8 in 0..15) of a (V, H) matrix, one
    scale/zero point per ``block_size`` consecutive columns of a row: the lever's own asymmetric
    round-to-nearest (:func:`encoderkit.compress.packing.rtn_quantize`)."""
    qt = rtn_quantize(torch.tensor(weight, dtype=torch.float32), QuantSpec(4, block_size, symmetric=False))
    return qt.q.numpy().astype(np.uint8), qt.scale.half().numpy(), qt.zero.numpy().astype(np.uint8)


def dequantize_uint4(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, block_size: int) -> np.ndarray:
    v, h = codes.shape
    c = codes.reshape(v, h // block_size, block_size).astype(np.float32)
    return ((c - zero[..., None].astype(np.float32)) * scale.astype(np.float32)[..., None]).reshape(v, h)


def _pack(codes: np.ndarray) -> bytes:
    """Two codes per byte, low nibble first, as ONNX stores UINT4."""
    return pack_int4(torch.from_numpy(codes.reshape(1, -1))).numpy().tobytes()


def int4_word_embeddings(src: str | Path, dst: str | Path, block_size: int = 64) -> dict[str, float]:
    """Rewrite ``src`` (an fp32 ONNX export) into ``dst`` with 4-bit word embeddings (the Gather of an initializer
    by ``input_ids``); returns the rows, the block size and the mean absolute dequantization error."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if block_size not in BLOCK_SIZES:
        raise EncoderkitError(f"int4 embeddings: block size {block_size} not supported; use one of {BLOCK_SIZES}")
    model = onnx.load(str(src))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    node = next((n for n in graph.node
                 if n.op_type == "Gather" and n.input[0] in inits and n.input[1] == "input_ids"), None)
    if node is None:
        raise EncoderkitError(f"{src}: no Gather of an embedding matrix by input_ids; cannot store the embeddings "
                              "in int4")
    weight = numpy_helper.to_array(inits[node.input[0]])
    v, h = weight.shape
    if h % block_size:
        raise EncoderkitError(f"int4 embeddings: hidden size {h} is not a multiple of the block size {block_size}")
    codes, scale, zero = uint4_blocks(weight, block_size)
    name = node.input[0]
    graph.initializer.remove(inits[name])
    nb = h // block_size
    graph.initializer.extend([
        helper.make_tensor(f"{name}_uint4", TensorProto.UINT4, [v, h], _pack(codes), raw=True),
        numpy_helper.from_array(scale, f"{name}_scale"),
        helper.make_tensor(f"{name}_zero", TensorProto.UINT4, [v, nb], _pack(zero), raw=True),
    ])
    half = f"{node.output[0]}_fp16"
    gbq = helper.make_node("GatherBlockQuantized",
                           [f"{name}_uint4", node.input[1], f"{name}_scale", f"{name}_zero"], [half],
                           name=f"{node.name}_int4", domain="com.microsoft", gather_axis=0, quantize_axis=1,
                           block_size=block_size)
    cast = helper.make_node("Cast", [half], [node.output[0]], name=f"{node.name}_cast", to=TensorProto.FLOAT)
    at = list(graph.node).index(node)
    graph.node.remove(node)
    graph.node.insert(at, cast)
    graph.node.insert(at, gbq)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(dst))
    err = float(np.abs(dequantize_uint4(codes, scale, zero, block_size) - weight).mean())
    return {"int4_embedding_rows": v, "int4_block_size": block_size, "int4_embedding_mean_abs_error": round(err, 6)}
