"""Where the parts of each encoder family sit in its Hugging Face module tree: one :class:`Anatomy` per family.

Every torch-side lever (head, FFN, magnitude and 2:4 pruning, torch INT8, GPTQ/RTN, QAT) finds the blocks, the
attention projections, the FFN and the norms through :func:`anatomy_of`, never through one family's attribute
names. Adding a family is adding one entry to :data:`ANATOMIES` (keyed by ``config.model_type``); a model of a
family without an entry is refused with a message that names the missing entry.

Paths are dotted module paths: ``layers`` from the base model (``model.base_model``), the others from one block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encoderkit.errors import EncoderkitError


@dataclass(frozen=True)
class Anatomy:
    """The parts of one family's blocks.

    - ``qkv``: the separate query, key and value projections (output rows grouped by head), or ``fused_qkv``: one
      Linear whose output rows are ``[3, heads, head_size]`` (ModernBERT's ``Wqkv``); ``extra_qk``: projections
      that exist only in some configs and are cut like Q/K (DeBERTa's ``pos_key_proj``/``pos_query_proj``).
    - ``attn_out``: the Linear that reads the concatenated heads (input columns grouped by head).
    - ``head_count_attrs``/``head_total_attrs``: ``(module path, attribute)`` pairs holding the number of heads and
      heads x head size, updated when heads are cut (a family whose forward infers both from shapes has none).
    - ``ffn_up``/``ffn_down``: the FFN's Linears; ``gated``: ``ffn_up`` holds ``[input; gate]`` halves of
      ``ffn_size`` rows each (a GLU, ModernBERT's ``Wi``), whose rows of one neuron are cut together.
    - ``norms``: the block's normalisations; ``heads_key``/``hidden_key``/``ffn_key``: the config's names of the
      head count, hidden size and FFN size. No family's config can say fewer heads of the same size (the
      attention output Linear is built ``hidden x hidden``), so head-pruned folders record the kept heads.
    """

    family: str
    layers: str
    attn_out: str
    ffn_up: str
    ffn_down: str
    norms: tuple[str, ...]
    qkv: tuple[str, str, str] | None = None
    fused_qkv: str | None = None
    extra_qk: tuple[str, ...] = ()
    head_count_attrs: tuple[tuple[str, str], ...] = ()
    head_total_attrs: tuple[tuple[str, str], ...] = ()
    gated: bool = False
    heads_key: str = "num_attention_heads"
    hidden_key: str = "hidden_size"
    ffn_key: str = "intermediate_size"

    # -- the blocks ------------------------------------------------------------------------------
    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The transformer blocks of ``model`` (a task model or its bare encoder)."""
        return list(_base(model).get_submodule(self.layers))

    def layer_prefix(self, model: torch.nn.Module) -> str:
        """The state-dict prefix of the blocks (``bert.encoder.layer.``), so a parameter name tells its block."""
        base = _base(model)
        names = {m: n for n, m in model.named_modules()}
        return f"{names[base.get_submodule(self.layers)]}.".lstrip(".")

    # -- the numbers -----------------------------------------------------------------------------
    def num_heads(self, config) -> int:
        return int(getattr(config, self.heads_key))

    def head_size(self, config) -> int:
        """The width of one head: ``hidden // heads`` of the (uncut) config."""
        return int(getattr(config, self.hidden_key) // self.num_heads(config))

    def ffn_size(self, config) -> int:
        return int(getattr(config, self.ffn_key))

    def block_heads(self, block: torch.nn.Module, head_size: int) -> int:
        """The heads a (possibly cut) block has now: the width ``attn_out`` reads, over the head size."""
        return block.get_submodule(self.attn_out).in_features // head_size

    # -- head rows and columns -------------------------------------------------------------------
    def head_rows(self, block: torch.nn.Module, heads: list[int], head_size: int) -> dict[str, torch.Tensor]:
        """``{projection path: its output rows}`` of ``heads`` (indices among the block's current heads)."""
        idx = _head_index(heads, head_size)
        if self.fused_qkv is not None:
            total = self.block_heads(block, head_size) * head_size
            rows = {self.fused_qkv: torch.cat([p * total + idx for p in range(3)])}
        else:
            rows = {path: idx for path in self.qkv or ()}
        for path in self.extra_qk:
            if _has(block, path):
                rows[path] = idx
        return rows

    def head_columns(self, heads: list[int], head_size: int) -> dict[str, torch.Tensor]:
        """``{attn_out: its input columns}`` of ``heads``."""
        return {self.attn_out: _head_index(heads, head_size)}

    def set_heads(self, block: torch.nn.Module, n_heads: int, head_size: int) -> None:
        """Record a block's new head count where its forward reads it."""
        for path, attr in self.head_count_attrs:
            setattr(block.get_submodule(path), attr, n_heads)
        for path, attr in self.head_total_attrs:
            setattr(block.get_submodule(path), attr, n_heads * head_size)

    # -- FFN neurons -----------------------------------------------------------------------------
    def ffn_rows(self, neurons: torch.Tensor, size: int) -> torch.Tensor:
        """The rows of ``ffn_up`` that hold ``neurons``: both halves of a gated FFN."""
        return torch.cat([neurons, neurons + size]) if self.gated else neurons

    def linears(self, block: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
        """``(path in the block, Linear)`` of every Linear of a block, in module order."""
        return [(n, m) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "base_model", model)


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _head_index(heads: list[int], head_size: int) -> torch.Tensor:
    if not heads:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(h * head_size, (h + 1) * head_size) for h in heads])


_BERT = {"layers": "encoder.layer", "qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
         "attn_out": "attention.output.dense", "ffn_up": "intermediate.dense", "ffn_down": "output.dense",
         "norms": ("attention.output.LayerNorm", "output.LayerNorm"),
         "head_count_attrs": (("attention.self", "num_attention_heads"),),
         "head_total_attrs": (("attention.self", "all_head_size"),)}

# model_type -> the family's anatomy; adding a family is adding one entry
ANATOMIES: dict[str, Anatomy] = {
    "bert": Anatomy("bert", **_BERT),  # BERT, MiniLM
    "roberta": Anatomy("roberta", **_BERT),
    "xlm-roberta": Anatomy("xlm-roberta", **_BERT),
    "electra": Anatomy("electra", **_BERT),
    "deberta-v2": Anatomy(  # DeBERTa-v2 and -v3 (relative position projections cut with their heads)
        "deberta-v2", layers="encoder.layer",
        qkv=("attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj"),
        extra_qk=("attention.self.pos_key_proj", "attention.self.pos_query_proj"),
        attn_out="attention.output.dense", ffn_up="intermediate.dense", ffn_down="output.dense",
        norms=("attention.output.LayerNorm", "output.LayerNorm"),
        head_count_attrs=(("attention.self", "num_attention_heads"),),
        head_total_attrs=(("attention.self", "all_head_size"),)),
    "distilbert": Anatomy(
        "distilbert", layers="transformer.layer", qkv=("attention.q_lin", "attention.k_lin", "attention.v_lin"),
        attn_out="attention.out_lin", ffn_up="ffn.lin1", ffn_down="ffn.lin2",
        norms=("sa_layer_norm", "output_layer_norm"), head_count_attrs=(("attention", "n_heads"),),
        heads_key="n_heads", hidden_key="dim", ffn_key="hidden_dim"),
    "modernbert": Anatomy(  # global and local (sliding-window) attention layers alike; forward infers the heads
        "modernbert", layers="layers", fused_qkv="attn.Wqkv", attn_out="attn.Wo", ffn_up="mlp.Wi",
        ffn_down="mlp.Wo", gated=True, norms=("attn_norm", "mlp_norm")),
}


def config_heads_hidden(config: dict) -> tuple[int, int]:
    """``(heads, hidden size)`` from a folder's ``config.json`` under the family's own keys (DistilBERT's ``n_heads``
    and ``dim``); BERT's names for a family without an entry, and 0 where a key is absent."""
    found = ANATOMIES.get(str(config.get("model_type", "")))
    heads, hidden = (found.heads_key, found.hidden_key) if found else ("num_attention_heads", "hidden_size")
    return int(config.get(heads) or 0), int(config.get(hidden) or 0)


def family_of(model: torch.nn.Module) -> str:
    """``config.model_type`` of ``model`` (its class name when it has no config)."""
    return getattr(getattr(model, "config", None), "model_type", "") or type(model).__name__


def anatomy_of(model: torch.nn.Module, stage: str = "") -> Anatomy:
    """The :class:`Anatomy` of ``model``'s family; a family without an entry is refused naming ``stage`` (the command
    that needs it, e.g. ``prune --method ffn``), the family and the missing entry."""
    family = family_of(model)
    found = ANATOMIES.get(family)
    if found is None:
        raise EncoderkitError(
            f"{stage or 'pruning and torch quantization'}: {family} models are not supported ({type(model).__name__}: "
            f"encoderkit/models/anatomy.py has no ANATOMIES[{family!r}] entry saying where its blocks, attention "
            f"projections and FFN are; families with one: {', '.join(sorted(ANATOMIES))}). Distillation into a "
            "supported family and ONNX INT8 (quantize --format onnx) work on any family")
    return found
