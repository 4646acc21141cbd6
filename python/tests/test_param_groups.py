"""gwt.paper_param_groups: the rule of gwt::paper_param_groups on torch.nn modules."""

import torch
from torch import nn

import gwt


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.attn = nn.MultiheadAttention(d, 2)


class LM(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.conv = nn.Conv1d(d, d, 3)
        self.lm_head = nn.Linear(d, vocab)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)


def names(model, groups):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [[by_id[id(p)] for p in g["params"]] for g in groups]


def test_linear_weights_are_wavelet_everything_else_dense():
    model = LM()
    groups = gwt.paper_param_groups(model, lr=3e-3)
    wavelet, dense = names(model, groups)
    assert wavelet == [
        "blocks.0.q.weight", "blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight",
        "blocks.0.attn.out_proj.weight",  # a torch.nn.Linear subclass, as in C++'s MultiheadAttention
        "blocks.1.q.weight", "blocks.1.mlp.0.weight", "blocks.1.mlp.2.weight",
        "blocks.1.attn.out_proj.weight",
    ]
    assert "embed.weight" in dense and "lm_head.weight" in dense and "conv.weight" in dense
    assert "blocks.0.attn.in_proj_weight" in dense and "blocks.0.norm.weight" in dense
    assert not any(n.startswith("frozen") for n in dense)  # no grad: in no group
    assert groups[0]["lr"] == groups[1]["lr"] == 3e-3
    assert "level" not in groups[0] and groups[1]["level"] == 0
    opt = gwt.WaveletAdam(groups, level=2)
    assert opt.is_wavelet_param(model.blocks[0].q.weight)
    assert not opt.is_wavelet_param(model.lm_head.weight)
    assert not opt.is_wavelet_param(model.embed.weight)


def test_overrides_by_name_and_head_names():
    model = LM()
    assignments = gwt.assign_param_groups(model, head_names=["q"], force_dense=["mlp.2"],
                                          force_wavelet=["lm_head.weight", "mlp.2.weight"])
    wavelet = {a.name for a in assignments if a.wavelet}
    assert "blocks.0.q.weight" not in wavelet  # a head by name
    assert "lm_head.weight" in wavelet  # forced
    assert "blocks.0.mlp.2.weight" not in wavelet  # force_dense wins
    assert [a.name for a in assignments] == [n for n, p in model.named_parameters()
                                             if p.requires_grad]


def test_a_model_without_linear_layers_has_one_dense_group():
    groups = gwt.paper_param_groups(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    assert len(groups) == 1 and groups[0]["level"] == 0
