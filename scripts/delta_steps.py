#!/usr/bin/env python3
"""Real training data for delta updates: a small PyTorch transformer
trained in bf16 with fp32 master weights and AdamW, each step's bf16 weights
written as safetensors, for each learning rate.

    .venv/bin/python scripts/delta_steps.py OUT_DIR [--steps 20] [--lrs 1e-6,1e-5]

Writes OUT_DIR/lr<LR>/step<K>.safetensors for K = 0 (the initial weights)
to STEPS. `wm bench delta --data OUT_DIR` reads them. Made at run time (a
few seconds on a CPU), never checked in. Deterministic (seeded).
"""
import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class Model(torch.nn.Module):
    def __init__(self, vocab=512, d=256, layers=4, heads=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train(out: Path, lr: float, steps: int) -> None:
    torch.manual_seed(0)
    master = Model()  # fp32 master weights
    model = Model().to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.01)
    data = torch.Generator().manual_seed(1)
    out.mkdir(parents=True, exist_ok=True)

    def publish(k: int):
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters()):
                p.copy_(m.to(torch.bfloat16))
        save_file({n: t.contiguous() for n, t in model.state_dict().items()}, str(out / f"step{k}.safetensors"))

    publish(0)
    for k in range(1, steps + 1):
        tokens = torch.randint(0, 512, (8, 64), generator=data)
        logits = model(tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))
        model.zero_grad()
        loss.backward()
        for p, m in zip(model.parameters(), master.parameters()):
            m.grad = p.grad.float()
        opt.step()
        publish(k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for lr in a.lrs.split(","):
        train(a.out / f"lr{lr}", float(lr), a.steps)


if __name__ == "__main__":
    main()
