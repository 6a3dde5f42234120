"""Small models written for the tests, independent of benchmarks/models.py.

They carry the awkward cases on purpose: a fused add+RMSNorm that overwrites its residual input in
place (so a dump taken after the fact would be wrong), a layer called with ``.forward()``
directly, tuple and dict outputs, a module called twice in one forward, and an EAGLE-style draft
that shares the target's embedding and LM head.
"""

import torch
from torch import nn


class FusedAddNorm(nn.Module):
    """residual += x; return rmsnorm(residual), residual  (residual updated IN PLACE)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.trace = None  # reference recorder (a list) set by leaf_reference

    def forward(self, x, residual):
        residual.add_(x)
        var = residual.pow(2).mean(-1, keepdim=True)
        out = residual * torch.rsqrt(var + 1e-6) * self.weight, residual
        if self.trace is not None:
            self.trace(out)
        return out


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cache):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        cache["k"].append(k)
        cache["v"].append(v)
        k, v = torch.cat(cache["k"], 1), torch.cat(cache["v"], 1)
        h = self.heads
        q, k, v = (z.view(b, -1, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5, dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.act = nn.SiLU()
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Layer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = FusedAddNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = FusedAddNorm(dim)
        self.mlp = Mlp(dim)

    def forward(self, x, residual, cache):
        h, residual = self.norm1(x, residual)
        h = self.attn(h, cache)
        h, residual = self.norm2(h, residual)
        return self.mlp(h), residual


class Stats(nn.Module):
    """Returns a dict, to exercise dict naming."""

    def forward(self, x):
        return {"mean": x.mean(-1), "max": x.amax(-1)}


class Body(nn.Module):
    def __init__(self, vocab, dim, layers, heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.final = FusedAddNorm(dim)
        self.stats = Stats()

    def forward(self, ids, caches):
        x = self.embed(ids)
        residual = torch.zeros_like(x)
        for i, layer in enumerate(self.layers):
            # Engine-style direct call: forward hooks would not fire here.
            x, residual = layer.forward(x, residual, caches[i]) if i % 2 else layer(x, residual, caches[i])
        h, _ = self.final.forward(x, residual)  # a leaf called directly, too
        self.stats(h)
        self.stats(h * 2)  # same module twice in one pass -> name#1
        return h


class TinyLM(nn.Module):
    def __init__(self, vocab=97, dim=32, layers=3, heads=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = Body(vocab, dim, layers, heads)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.n_layers = layers

    def new_cache(self):
        return [{"k": [], "v": []} for _ in range(self.n_layers)]

    def forward(self, ids, caches):
        return self.lm_head(self.model(ids, caches))


class TinyDraft(nn.Module):
    """EAGLE-style: fc(concat(target hidden, token embedding)) -> one layer; shares embed and head."""

    def __init__(self, target: TinyLM, heads=4, seed=1):
        super().__init__()
        torch.manual_seed(seed)
        dim = target.model.embed.embedding_dim
        self.embed = target.model.embed
        self.fc = nn.Linear(2 * dim, dim)
        self.layer = Layer(dim, heads)
        self.norm = FusedAddNorm(dim)
        self.lm_head = target.lm_head

    def forward(self, ids, hidden, cache):
        x = self.fc(torch.cat([hidden, self.embed(ids)], -1))
        x, residual = self.layer(x, torch.zeros_like(x), cache)
        h, _ = self.norm(x, residual)
        return self.lm_head(h), h


class LeafReference:
    """Clones of every leaf module's output at the moment it returned, keyed like fastdump names.

    Uses plain forward hooks (they run right after the module returns, before any later in-place
    kernel), and FusedAddNorm's own trace, since one of them is called with .forward() (hooks miss
    that). Records only while ``active`` (the draft shares modules with the target).
    """

    def __init__(self, model):
        self.model = model
        self.active = False
        self.passes = []  # one list of (name, tensor) per recorded forward
        self._counts = {}
        self._handles = []
        for name, mod in model.named_modules():
            if not name or next(iter(mod.children()), None) is not None:
                continue
            if isinstance(mod, FusedAddNorm):
                mod.trace = lambda out, name=name: self._add(name, out)
            else:
                self._handles.append(mod.register_forward_hook(lambda m, i, o, name=name: self._add(name, o)))

    def __call__(self, *args, **kwargs):
        """Run the model once, recording its leaves as one pass."""
        self.passes.append([])
        self._counts = {}
        self.active = True
        try:
            return self.model(*args, **kwargs)
        finally:
            self.active = False

    def _add(self, name, value):
        if not self.active:
            return
        k = self._counts.get(name, 0)
        self._counts[name] = k + 1
        self._flatten(name if k == 0 else f"{name}#{k}", value)

    def _flatten(self, name, value):
        if isinstance(value, torch.Tensor):
            self.passes[-1].append((name, value.detach().clone()))
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                self._flatten(f"{name}.{i}", v)
        elif isinstance(value, dict):
            for k, v in value.items():
                self._flatten(f"{name}.{k}", v)

    def remove(self):
        for h in self._handles:
            h.remove()
        for mod in self.model.modules():
            if isinstance(mod, FusedAddNorm):
                mod.trace = None


class Chain(nn.Module):
    """``n`` Linear(4, 4) layers in a container at ``layers``, run in its order (a ModuleList, a
    Sequential or a ModuleDict put there later: the tests of module edits after attach)."""

    def __init__(self, n):
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x):
        for layer in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            x = layer(x)
        return x
