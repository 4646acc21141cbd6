"""A Hugging Face model trained by the Hugging Face Trainer with gwt.WaveletAdam.

A randomly initialised LlamaForCausalLM (built from a config: nothing is downloaded) learns the
bytes of the fortunes text (train_lm.py's corpus) as token ids 0-255. The optimizer is handed to
the Trainer with its scheduler; gwt.paper_param_groups recognises Hugging Face's names (the
linear layers of the blocks on the wavelet path; embed_tokens, lm_head and the norms dense):

    opt = gwt.WaveletAdam(gwt.paper_param_groups(model, weight_decay=0.1), lr=3e-3, scale=0.25)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, scheduler))

    pip install --no-build-isolation ./python       # once, where torch is installed
    pip install transformers accelerate             # scripts/setup.sh pins the tested versions
    python examples/python/hf_trainer.py --steps 200

About 10 s per 100 steps on 2 cores. python/tests/test_hf_trainer.py runs it for a few steps.
"""

import argparse
import math
import os
import sys
import tempfile

import torch

import gwt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import load_text  # noqa: E402  (the same corpus as the LM example)


def build_model(seed=0):
    """A small LLaMA (2 blocks of width 64) over 256 byte ids, randomly initialised."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class ByteChunks(torch.utils.data.Dataset):
    """Consecutive chunks of `length` bytes of a text, each an example whose labels are its ids
    (the model shifts them)."""

    def __init__(self, text, length):
        self.ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.length = length

    def __len__(self):
        return self.ids.numel() // self.length

    def __getitem__(self, i):
        x = self.ids[i * self.length:(i + 1) * self.length]
        return {"input_ids": x, "labels": x}


def make_optimizer(model, lr, steps):
    """WaveletAdam on the paper's groups, with linear warm-up over a tenth of the steps and then a
    cosine decay to a tenth of lr."""
    opt = gwt.WaveletAdam(gwt.paper_param_groups(model, weight_decay=0.1), lr=lr, scale=0.25)
    warmup = max(1, steps // 10)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train(steps=200, lr=3e-3, batch=16, length=128, corpus="", seed=0, output_dir=None):
    """Trains for `steps` steps; returns (model, optimizer, the Trainer's log history)."""
    from transformers import Trainer, TrainingArguments

    model = build_model(seed)
    opt, scheduler = make_optimizer(model, lr, steps)
    data = ByteChunks(load_text(corpus), length)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(output_dir=output_dir or scratch, max_steps=steps,
                                 per_device_train_batch_size=batch,
                                 logging_steps=max(1, steps // 10), save_strategy="no",
                                 report_to="none", use_cpu=True, seed=seed,
                                 dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, scheduler))
        trainer.train()
    return model, opt, trainer.state.log_history


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus", default="", help="a text file (default: fortunes)")
    a = parser.parse_args()
    model, opt, history = train(a.steps, a.lr, corpus=a.corpus)
    for entry in history:
        if "loss" in entry:
            print(f"step {entry['step']:5d}  loss {entry['loss']:.4f}  "
                  f"lr {entry['learning_rate']:.2e}")
    dense = sum(p.numel() for g in opt.param_groups if g["level"] == 0 for p in g["params"])
    wavelet = sum(p.numel() for g in opt.param_groups if g["level"] > 0 for p in g["params"])
    print(f"parameters: {wavelet} on the wavelet path, {dense} dense; "
          f"optimizer state {opt.state_bytes()} bytes")


if __name__ == "__main__":
    main()
