"""The tiny decoder-only language model the RL example trains, and the
fixed probes (inputs and a prompt) whose outputs the trainer and the C++
engine compare at every version.

Architecture (engine.cpp computes exactly this, in the same order):
  x = tok_emb[tokens] + pos_emb[0..T)
  per block: x += proj(causal_attention(ln1(x)));  x += mlp(ln2(x))
             mlp(h) = proj(gelu(fc(h)))   (exact erf GELU)
  logits = head(ln_f(x))
Pre-LayerNorm (eps 1e-5), learned positional embeddings, and an untied LM
head (`head.weight`, no bias): untied so every tensor the engine reads is
one param it registered, with no aliasing between two names.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 64
D_MODEL = 64
LAYERS = 2
HEADS = 4
CONTEXT = 32


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // HEADS
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, hd).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.proj = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = Mlp()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# The probes: two fixed sequences of the full context, and a prompt that the
# greedy continuation extends to the full context. engine.cpp holds the same
# numbers (probe_tokens / PROMPT); the driver checks that both sides agree by
# comparing outputs, and the trainer writes them out for the engine to check.
def probe_inputs():
    a = [(3 * i + 1) % VOCAB for i in range(CONTEXT)]
    b = [(7 * i + 5) % VOCAB for i in range(CONTEXT)]
    return torch.tensor([a, b], dtype=torch.long)


PROMPT = [1, 4, 7, 10, 13, 16, 19, 22]
GENERATE = CONTEXT - len(PROMPT)


@torch.no_grad()
def greedy_continuation(model, prompt=PROMPT, steps=GENERATE):
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([tokens], dtype=torch.long))[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def corpus_batch(generator, batch, length=CONTEXT + 1):
    """Arithmetic progressions modulo VOCAB: a start and a stride (1 to 7)
    per sequence. The next token follows from the two before it, so the
    model visibly learns (the loss falls from ln 64 = 4.16 within a few
    dozen steps)."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    return (start + stride * torch.arange(length)) % VOCAB
