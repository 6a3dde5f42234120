"""CPU stand-ins of the way SGLang and vLLM run EAGLE speculative decoding, for
tests/test_eagle_engines.py (also imported by the engine processes it starts).

A target and an EAGLE-3-style draft (one layer, ``fc`` over [embedding, target hidden]) whose
embedding and LM head are the target's modules themselves (``set_embed_and_head``), each step:
``k`` draft decode steps (``topk`` branches after the first), a target verify of the token tree
under a custom attention mask, a ``draft_extend`` of the accepted tokens. The vLLM shape differs in
one way that matters to a dumper: the model's ``forward`` returns hidden states and the engine calls
``compute_logits`` after it, outside the forward."""

import math

import torch
from torch import nn

H, V = 16, 40


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(H) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(H, 3 * H, bias=False)
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, x, mask):
        q, k, v = self.qkv_proj(x).chunk(3, -1)
        scores = q @ k.T / math.sqrt(H)
        if mask is not None:  # the verify forward's tree mask
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.o_proj(torch.softmax(scores, -1) @ v)


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm()
        self.self_attn = Attention()
        self.up_proj = nn.Linear(H, 2 * H)
        self.down_proj = nn.Linear(2 * H, H)

    def forward(self, x, mask):
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class Body(nn.Module):
    def __init__(self, layers, fc=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        if fc:
            self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(layers))
        self.norm = RMSNorm()

    def forward(self, ids, mask, hidden=None):
        x = self.embed_tokens(ids)
        if hidden is not None:
            x = self.fc(torch.cat([x, hidden], -1))
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class Target(nn.Module):
    """SGLang's shape: the forward computes the logits. Returns (logits, hidden)."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        super().__init__()
        self.model = Body(2)
        self.lm_head = nn.Linear(H, V, bias=False)

    @torch.no_grad()
    def forward(self, ids, mask=None):
        hidden = self.model(ids, mask)
        return self.lm_head(hidden), hidden


class Draft(nn.Module):
    """EAGLE-3's draft: its body under another name than the target's (``midlayer``)."""

    def __init__(self, seed=1):
        torch.manual_seed(seed)
        super().__init__()
        self.midlayer = Body(1, fc=True)
        self.lm_head = nn.Linear(H, V, bias=False)

    def set_embed_and_head(self, embed, head):
        """The target's modules themselves, as the engines' EAGLE workers share them."""
        self.midlayer.embed_tokens = embed
        self.lm_head = head

    @torch.no_grad()
    def forward(self, ids, hidden):
        hidden = self.midlayer(ids, None, hidden)
        return self.lm_head(hidden), hidden


def tree_mask(n):
    """A token tree's attention mask: each token sees itself and some earlier ones."""
    g = torch.Generator().manual_seed(n)
    return (torch.tril(torch.ones(n, n, dtype=torch.bool)) & (torch.rand(n, n, generator=g) > 0.3)) | \
        torch.eye(n, dtype=torch.bool)


def eagle_schedule(steps=2, k=3, topk=2, seed=3):
    """[(role, forward_mode, args)] in the order SGLang's EAGLE worker runs them: target extend, draft
    extend, then per step ``k`` draft decode steps (``topk`` branches after the first), a target
    verify of the 1 + k * topk tree tokens under a tree mask, and a draft extend of k + 1 tokens."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, V, (n,), generator=g)

    def hidden(n):
        return torch.randn(n, H, generator=g)

    out = [("target", "extend", (ids(5), torch.tril(torch.ones(5, 5, dtype=torch.bool)))),
           ("draft", "draft_extend", (ids(5), hidden(5)))]
    for _ in range(steps):
        for j in range(k):
            n = 1 if j == 0 else topk
            out.append(("draft", "draft_decode", (ids(n), hidden(n))))
        n = 1 + k * topk
        out.append(("target", "target_verify", (ids(n), tree_mask(n))))
        out.append(("draft", "draft_extend", (ids(k + 1), hidden(k + 1))))
    return out


# --- vLLM's shape ---------------------------------------------------------------------------------


class LogitsProcessor(nn.Module):
    def forward(self, lm_head, hidden):  # vLLM: lm_head.quant_method.apply(lm_head, hidden)
        return hidden @ lm_head.weight.T


class ParallelLMHead(nn.Module):
    """Holds the weight; never called (the logits processor multiplies by it)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, H))


class VllmTarget(nn.Module):
    def __init__(self, seed=0):
        torch.manual_seed(seed)
        super().__init__()
        self.model = Body(2)
        self.lm_head = ParallelLMHead()
        self.logits_processor = LogitsProcessor()

    def forward(self, ids, mask=None):
        return self.model(ids, mask)

    def compute_logits(self, hidden):
        return self.logits_processor(self.lm_head, hidden)


class VllmDraft(VllmTarget):
    def __init__(self, seed=1):
        torch.manual_seed(seed)
        nn.Module.__init__(self)
        self.model = Body(1, fc=True)
        self.lm_head = ParallelLMHead()
        self.logits_processor = LogitsProcessor()

    def forward(self, ids, hidden):
        return self.model(ids, None, hidden)


def load_drafter(target, draft):
    """vLLM's EagleProposer.load_model: the draft takes the target's modules, after it is loaded."""
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
