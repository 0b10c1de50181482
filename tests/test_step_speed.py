"""The training-step levers change speed, not what a step computes (encoderkit.train.step_speed)."""

from __future__ import annotations

import pytest
import torch

from encoderkit.models.load import build_encoder
from encoderkit.models.mlm import MaskedOnlyMLM
from encoderkit.models.presets import build_config
from encoderkit.train import step_speed


def _tiny_mlm() -> torch.nn.Module:
    config = build_config(None, 120, 64, layers=2, hidden=32, heads=4, ffn=64, dropout=0.0,
                          special_ids={"pad": 0, "cls": 2, "sep": 3})
    return MaskedOnlyMLM(build_encoder(config, seed=0))


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 120, (3, 20), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 12:] = 0  # padding: the mask path of both kernels
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    return ids, attention, labels


def test_training_attention_is_eager_inside_and_restored_after() -> None:
    module = _tiny_mlm()
    inner = module.model
    assert inner.config._attn_implementation == "sdpa"
    with step_speed.training_attention(module, torch.device("cpu")):
        assert inner.config._attn_implementation == "eager"
    assert inner.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), step_speed.training_attention(module, torch.device("cpu")):
        raise RuntimeError("a failed step")
    assert inner.config._attn_implementation == "sdpa"  # restored on an error too
    with step_speed.training_attention(module, torch.device("cuda")):  # SDPA's fused kernels pay on a GPU
        assert inner.config._attn_implementation == "sdpa"


def test_eager_training_attention_computes_the_same_loss_and_gradients() -> None:
    module = _tiny_mlm()
    ids, attention, labels = _batch()
    loss_sdpa = module(ids, labels, attention)[0]
    loss_sdpa.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    with step_speed.training_attention(module, torch.device("cpu")):
        loss_eager = module(ids, labels, attention)[0]
        loss_eager.backward()
    assert torch.allclose(loss_sdpa, loss_eager, atol=1e-5)
    for n, p in module.named_parameters():
        if n in grads:
            assert torch.allclose(grads[n], p.grad, atol=1e-5), n


def test_fused_adamw_only_for_float_parameters_on_cpu_and_cuda() -> None:
    module = _tiny_mlm()
    assert step_speed.fused_adamw(module, torch.device("cpu")) is True
    assert step_speed.fused_adamw(module, torch.device("meta")) is None
    module.model.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))
    assert step_speed.fused_adamw(module, torch.device("cpu")) is None


def _tiny_classifier() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def test_embedding_grad_buffer_gives_the_same_gradients_and_steps_with_accumulation_and_clipping() -> None:
    import copy

    stock = _tiny_classifier()
    buffered = copy.deepcopy(stock)
    emb = buffered.bert.embeddings.word_embeddings
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (stock, buffered)]
    g = torch.Generator().manual_seed(1)
    with step_speed.embedding_grad_buffer(buffered, torch.device("cpu")):
        assert emb.sparse
        buffers = set()
        for _ in range(3):
            for _micro in range(2):  # two micro-batches accumulate into one gradient
                ids, y = torch.randint(0, 300, (3, 7), generator=g), torch.randint(0, 2, (3,), generator=g)
                for m in (stock, buffered):
                    m(input_ids=ids, labels=y).loss.backward()
            grad = emb.weight.grad
            assert not grad.is_sparse
            buffers.add(grad.data_ptr())
            assert torch.equal(grad, stock.bert.embeddings.word_embeddings.weight.grad)
            for m, opt in zip((stock, buffered), opts):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert len(buffers) == 1  # one buffer for the run: no fresh vocabulary-sized block per step
    assert not emb.sparse and not emb._forward_pre_hooks  # as it was after the block
    for p, q in zip(stock.parameters(), buffered.parameters()):
        assert torch.equal(p, q)


def test_embedding_grad_buffer_leaves_tied_embeddings_and_other_devices_alone() -> None:
    module = _tiny_mlm()  # the MLM head's decoder shares the input embedding's weight
    emb = module.model.get_input_embeddings()
    with step_speed.embedding_grad_buffer(module, torch.device("cpu")):
        tied = emb.sparse
    classifier = _tiny_classifier()
    with step_speed.embedding_grad_buffer(classifier, torch.device("cuda")):
        on_cuda = classifier.bert.embeddings.word_embeddings.sparse
    with step_speed.embedding_grad_buffer(classifier, torch.device("cpu"), enabled=False):
        disabled = classifier.bert.embeddings.word_embeddings.sparse
    assert (tied, on_cuda, disabled) == (False, False, False)


def test_dropout_drops_p_rounded_to_1_65536_unbiased_and_repeats_with_the_seed() -> None:
    x = torch.ones(400_000, requires_grad=True)
    torch.manual_seed(3)
    y = step_speed.dropout(x, 0.1)
    dropped = float((y == 0).float().mean())
    assert abs(dropped - 0.1) < 0.003  # 4 sigma at 400,000 draws
    assert abs(float(y.detach().mean()) - 1.0) < 0.004  # kept values scaled by the exact inverse: the mean stays
    torch.manual_seed(3)
    assert torch.equal(step_speed.dropout(x, 0.1), y)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the gradient passes where the value did, scaled alike
    assert step_speed.dropout(x, 0.0) is x
    assert float(step_speed.dropout(x, 1.0).abs().sum()) == 0.0


def test_quick_dropout_only_while_training_on_cpu_and_restored() -> None:
    layer = torch.nn.Dropout(0.5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), layer)
    x = torch.ones(64, 4)
    with step_speed.quick_dropout(model, torch.device("cpu")):
        assert "forward" in vars(layer)
        torch.manual_seed(0)
        out = layer(x)
        assert set(out.unique().tolist()) <= {0.0, 2.0} and 0 < int((out == 0).sum()) < out.numel()
        layer.eval()
        assert torch.equal(layer(x), x)
        layer.train()
    assert "forward" not in vars(layer)
    with step_speed.quick_dropout(model, torch.device("cuda")):
        assert "forward" not in vars(layer)
