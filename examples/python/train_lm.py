"""A small byte-level language model trained with torch.optim.AdamW and with gwt.WaveletAdam: the
Python side of examples/train_lm (which the README's main job runs in C++).

    pip install --no-build-isolation ./python      # once, in the environment that has torch
    python examples/python/train_lm.py              # both optimizers, about 20 s on 2 cores

The swap is one line (see make_optimizer):

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt = gwt.WaveletAdam(gwt.paper_param_groups(model), lr=3e-3, weight_decay=0.1, scale=0.25)

The corpus is the English text of Debian's fortunes package when it is installed
(/usr/share/games/fortunes), any text file given with --corpus, or else a generated text.
"""

import argparse
import math
import os
import random
import time

import torch
from torch import nn
from torch.nn import functional as F

import gwt


def load_text(path):
    if path:
        with open(path, "rb") as f:
            return f.read()
    directory = "/usr/share/games/fortunes"
    if os.path.isdir(directory):
        chunks = []
        for name in sorted(os.listdir(directory)):
            full = os.path.join(directory, name)
            if os.path.isfile(full) and "." not in name:  # skip the .dat indexes and .u8 links
                with open(full, "rb") as f:
                    chunks.append(f.read())
        if chunks:
            return b"\n".join(chunks)
    # No corpus: sentences from a small grammar, enough for the loss to fall.
    rng = random.Random(0)
    subjects = ["the cat", "a wavelet", "the optimizer", "my compiler", "every tensor"]
    verbs = ["eats", "compresses", "ignores", "updates", "admires"]
    objects = ["the moments", "a gradient", "the fish", "two cores", "the learning rate"]
    return " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
                    for _ in range(40000)).encode()


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, d=128, layers=2, heads=4, seq_len=64):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(seq_len, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, 256, bias=False)  # "lm_head": kept dense by paper_param_groups

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def make_optimizer(name, model):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    # The one-line swap: linear layers' weights take the wavelet path, embeddings, norms and the
    # head stay dense (as in the paper); lr and scale as the C++ main job's tuned defaults.
    return gwt.WaveletAdam(gwt.paper_param_groups(model), lr=3e-3, weight_decay=0.1, scale=0.25)


def batches(data, batch, seq_len, generator):
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator)
    x = torch.stack([data[s: s + seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1: s + 1 + seq_len] for s in starts.tolist()])
    return x.long(), y.long()


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def validation_loss(model, val_data, batch, seq_len):
    """Mean loss over 20 fixed batches (seed 2) of val_data, in eval mode."""
    model.eval()
    val_gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                  for x, y in (batches(val_data, batch, seq_len, val_gen) for _ in range(20))]
    return sum(losses) / len(losses)


def train(name, train_data, val_data, args):
    torch.manual_seed(0)
    model = TinyLM(seq_len=args.seq_len)
    opt = make_optimizer(name, model)
    sched = torch.optim.lr_scheduler.LambdaLR(  # warm-up, then cosine to 0.1 of the peak
        opt, lambda t: min(1.0, (t + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / args.steps))))
    gen = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batches(train_data, args.batch, args.seq_len, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"  {name:8s} step {step + 1:4d}  train loss {loss.item():.3f}", flush=True)
    seconds = time.perf_counter() - start
    return validation_loss(model, val_data, args.batch, args.seq_len), state_bytes(opt), seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default="adamw,wavelet",
                        help="comma-separated: adamw, wavelet (default both)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--corpus", default="", help="a text file (default: fortunes)")
    args = parser.parse_args()
    names = args.optimizers.split(",")
    for name in names:
        if name not in ("adamw", "wavelet"):
            parser.error(f"unknown optimizer '{name}' (valid: adamw, wavelet)")

    data = torch.frombuffer(bytearray(load_text(args.corpus)), dtype=torch.uint8)
    split = int(0.95 * data.numel())
    train_data, val_data = data[:split], data[split:]
    print(f"corpus: {data.numel()} bytes; {args.steps} steps of {args.batch} x {args.seq_len}")
    results = {name: train(name, train_data, val_data, args) for name in names}
    print("\n| optimizer | val loss (nats/byte) | state bytes | seconds |")
    print("|---|---:|---:|---:|")
    for name, (val, nbytes, seconds) in results.items():
        label = "torch.optim.AdamW" if name == "adamw" else "gwt.WaveletAdam haar L=2"
        print(f"| {label} | {val:.4f} | {nbytes} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
