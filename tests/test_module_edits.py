"""Edits of the model's module tree after attach that torch's registration hook does not see:
removals (``delattr``, ``ModuleDict`` ``del``/``pop``/``clear``) are followed; direct writes to a
module's ``_modules`` (``torch.ao.quantization.convert``, ``swap_submodule``) cannot be, and make
``fastdump verify`` fail naming the module."""

import json

import pytest
import torch
from torch import nn

import fastdump
from fastdump.capture import following as following_mod
from fastdump.cli.dump import verify_dump

from conftest import same_bits
from toy_models import Chain


class Heads(nn.Module):
    """Runs its ModuleDict's heads in order, then ``extra`` when it has one, then the modules of
    ``outside`` (a plain list: not part of the model's tree)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        self.outside = []

    def forward(self, x):
        for head in self.heads.values():
            x = head(x)
        if "extra" in self._modules:
            x = self.extra(x)
        for module in self.outside:
            x = module(x)
        return x


REMOVALS = {
    "delattr": lambda heads: (heads.a, delattr(heads, "a"))[0],
    "moduledict_pop": lambda heads: heads.pop("a"),
    "moduledict_del": lambda heads: (heads["a"], heads.__delitem__("a"))[0],
    "moduledict_clear": lambda heads: (heads["a"], heads.clear())[0],
}


def _run_and_expect(model, x):
    """The model's output and what each name in the tree should hold, computed undumped."""
    want, h = {}, x
    with torch.no_grad():
        out = model(x)
        for key, head in model.heads.items():
            h = want[f"heads.{key}"] = head(h)
        if "extra" in model._modules:
            h = want["extra"] = model.extra(h)
        for module in model.outside:
            h = module(h)
    return out, want


def _chain_outputs(model, x):
    """A Chain's output and what each of its layers returns, computed undumped."""
    want, h = {}, x
    with torch.no_grad():
        out = model(x)
        for key, layer in model.layers.named_children():
            h = want[f"layers.{key}"] = layer(h)
    return out, want


def _closed_with_exactly(d, root, want: dict, top: str, out) -> dict:
    """Close ``d``: its pass 0 holds ``want`` (name -> tensor) and the root module ``top``'s ``out``,
    nothing else, bit for bit; no edit went unfollowed and verify is clean. What was dumped."""
    stats = d.close()
    dumped = fastdump.open(root).load("target", 0, 0)
    assert sorted(dumped) == sorted([*want, top])
    for name, value in want.items():
        assert same_bits(dumped[name], value), name
    assert same_bits(dumped[top], out)
    assert stats["modules_not_followed"] == [] and verify_dump(str(root)).problems == []
    return dumped


@pytest.mark.parametrize("then", ["put_back_as_extra", "run_outside_the_model"])
@pytest.mark.parametrize("removal", sorted(REMOVALS))
def test_a_module_removed_from_the_model_after_attach_is_dumped_only_where_the_model_holds_it(
        tmp_path, kind, removal, then):
    """A module removed by ``delattr`` or a ModuleDict's ``del``/``pop``/``clear`` (writes to
    ``_modules`` that torch's registration hook does not see) kept its wrapper and its old name:
    put back as ``extra`` it dumped as ``heads.a``; run from outside the model it dumped as
    ``heads.a`` too, a module the model no longer has. verify said OK. Now a removed module is
    dumped under the name the model gives it, and not at all while the model has none for it."""
    model = Heads()
    d = fastdump.attach(model, tmp_path)
    removed = REMOVALS[removal](model.heads)
    if then == "put_back_as_extra":
        model.extra = removed
    else:
        model.outside.append(removed)
    x = torch.randn(2, 4)
    out, want = _run_and_expect(model, x)
    d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert sorted(dumped) == sorted(list(want) + ["Heads"])
    for name, value in want.items():
        assert same_bits(dumped[name], value), name
    assert same_bits(dumped["Heads"], out)
    assert verify_dump(str(tmp_path)).problems == []
    for module in model.modules():
        assert "forward" not in module.__dict__, module
    assert "forward" not in removed.__dict__


class Doubled(nn.Module):
    """What torch.ao.quantization.convert swaps a Linear for (from_float, as a quantized module)."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x) * 2

    @classmethod
    def from_float(cls, mod):
        return cls(nn.Linear(mod.in_features, mod.out_features))


def _ao_convert(heads):
    heads.a.qconfig = torch.ao.quantization.default_qconfig  # (swap_module swaps what has a qconfig)
    torch.ao.quantization.convert(heads, mapping={nn.Linear: Doubled}, inplace=True)


def _swap_submodule(heads):
    from torch.nn.utils._named_member_accessor import swap_submodule

    swap_submodule(heads, "a", nn.Linear(4, 4))


UNSEEN = {  # edit -> (what it does, the names verify must name)
    "modules_setitem_new": (lambda heads: heads._modules.__setitem__("a", nn.Linear(4, 4)), ["heads.a"] * 2),
    "modules_setitem_added": (lambda heads: heads._modules.__setitem__("c", nn.Linear(4, 4)), ["heads.c"]),
    "swap_submodule": (_swap_submodule, ["heads.a"] * 2),  # (the new one not dumped, the old one left)
    "ao_quantization_convert": (_ao_convert, ["heads.a.linear", "heads.a"]),
    "modules_del": (lambda heads: heads._modules.__delitem__("a"), ["heads.a"]),
    "modules_pop": (lambda heads: heads._modules.pop("a"), ["heads.a"]),
    "modules_clear": (lambda heads: heads._modules.clear(), ["heads.a", "heads.b"]),
}


@pytest.mark.parametrize("edit", sorted(UNSEEN))
def test_direct_writes_to_modules_after_attach_make_verify_fail_naming_the_module(tmp_path, kind, edit):
    """A write to a module's ``_modules`` (torch.ao.quantization's convert, ``swap_submodule``,
    ``del parent._modules[k]``) calls no hook fastdump can follow: a module put in so was never
    dumped, one taken out so still dumped under a name that no longer leads to it, and verify said
    OK. At close the Dumper compares the model's tree with what it wraps: each difference is in
    rank.json (stats.modules_not_followed) and verify fails, naming the module."""
    model = Heads()
    d = fastdump.attach(model, tmp_path)
    do, names = UNSEEN[edit]
    do(model.heads)
    with torch.no_grad():
        model(torch.randn(2, 4))
    stats = d.close()
    listed = stats["modules_not_followed"]
    assert sorted(entry.split(":")[0] for entry in listed) == sorted(names)
    info = json.loads((next(tmp_path.rglob("rank.json"))).read_text())
    assert info["stats"]["modules_not_followed"] == listed
    problems = verify_dump(str(tmp_path)).problems
    assert len(problems) == 1
    for name in names:
        assert f"{name}: " in problems[0], problems
    assert "could not follow" in problems[0]


def test_edits_torch_reports_leave_no_trace_in_the_check_at_close(tmp_path, kind):
    """The followed edits (setattr, ModuleDict assignment, LoRA-style wrapping, a removal) leave
    the tree and the wrappers in agreement: nothing listed, verify OK."""
    model = Heads()
    d = fastdump.attach(model, tmp_path)

    class LoRA(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.up = base, nn.Linear(4, 4)

        def forward(self, x):
            return self.base(x) + self.up(x)

    model.heads["b"] = LoRA(model.heads["b"])  # the old b keeps its name inside it
    model.extra = model.heads.pop("a")
    model.heads.update({"c": nn.Linear(4, 4)})  # (ModuleDict.update assigns each: registered)
    with torch.no_grad():
        model(torch.randn(2, 4))
    stats = d.close()
    assert stats["modules_not_followed"] == []
    assert verify_dump(str(tmp_path)).problems == []
    assert sorted(fastdump.open(tmp_path).load("target", 0, 0)) == [
        "Heads", "extra", "heads.b", "heads.b.up", "heads.c"]


@pytest.mark.parametrize("damaged", [3, "heads.a", [1], None])
def test_verify_fails_a_damaged_list_of_edits_not_followed(tmp_path, damaged):
    """rank.json's stats.modules_not_followed is a list of texts: anything else must not pass for
    an empty list (a damaged file hiding a module's missing outputs)."""
    import conftest

    model = Heads()
    d = fastdump.attach(model, tmp_path)
    with torch.no_grad():
        model(torch.randn(2, 4))
    d.close()
    assert verify_dump(str(tmp_path)).problems == []
    rank_dir = next(tmp_path.rglob("rank.json")).parent
    info = conftest.read_rank_json(rank_dir)
    info["stats"]["modules_not_followed"] = damaged
    conftest.write_rank_json(rank_dir, info)
    problems = verify_dump(str(tmp_path)).problems
    assert len(problems) == 1 and "stats.modules_not_followed is " in problems[0] and "not a list of texts" in problems[0]


def test_a_module_replaced_by_one_that_does_not_hold_it_is_no_longer_dumped(tmp_path, kind):
    """``heads["a"] = Doubled(new Linear)`` (transformers' pruned lm_head does this): the new
    module is no leaf, so no newcomer took the name ``heads.a`` from the old Linear, which kept its
    wrapper: run from outside the model it was dumped as ``heads.a``, verify OK. Now it leaves
    with its place; the new module's Linear is dumped as ``heads.a.linear``."""
    model = Heads()
    d = fastdump.attach(model, tmp_path)
    old = model.heads["a"]
    torch.manual_seed(9)
    model.heads["a"] = Doubled(nn.Linear(4, 4))
    model.outside.append(old)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x)
        inner = model.heads["a"].linear(x)
        b = model.heads["b"](inner * 2)
    _closed_with_exactly(d, tmp_path, {"heads.a.linear": inner, "heads.b": b}, "Heads", out)
    assert "forward" not in old.__dict__


CONTAINER_SWAPS = {
    "slice": lambda m: setattr(m, "layers", m.layers[2:]),
    "reversed": lambda m: setattr(m, "layers", nn.ModuleList(list(m.layers)[::-1])),
    "sequential_slice": lambda m: setattr(m, "layers", nn.Sequential(*m.layers)[1:]),
    "one_kept_one_new": lambda m: setattr(m, "layers", nn.ModuleList([nn.Linear(4, 4), m.layers[0]])),
    "dict_rekeyed": lambda m: setattr(m, "layers", nn.ModuleDict({"b": m.layers[1], "a": m.layers[3]})),
}


@pytest.mark.parametrize("swap", sorted(CONTAINER_SWAPS))
def test_a_container_replaced_by_one_holding_its_modules_elsewhere_renames_them(tmp_path, kind, swap):
    """``model.layers = model.layers[2:]`` (or a reordered ModuleList): the modules kept were
    already wrapped and kept their old numbers, so ``layers.2`` held what the model now calls
    ``layers.0``, and after a reversal ``layers.3`` held the first layer's output; verify said OK.
    Each module takes the name the new container gives it, as a Dumper attached after the change
    names it, bit for bit."""
    model = Chain(4)
    d = fastdump.attach(model, tmp_path / "during")
    CONTAINER_SWAPS[swap](model)
    x = torch.randn(2, 4)
    out, want = _chain_outputs(model, x)
    dumped = _closed_with_exactly(d, tmp_path / "during", want, "Chain", out)
    after = fastdump.attach(model, tmp_path / "after")  # the same model attached after the change
    with torch.no_grad():
        model(x)
    after.close()
    assert sorted(fastdump.open(tmp_path / "after").load("target", 0, 0)) == sorted(dumped)
    for module in model.modules():
        assert "forward" not in module.__dict__, module


def test_a_direct_write_swapping_two_modules_places_makes_verify_fail(tmp_path, kind):
    """``layers._modules["0"], layers._modules["1"] = ...["1"], ...["0"]``: no hook reports it, every
    module is still in the model and wrapped, so the check at close found nothing; each layer's
    output was dumped under the other's name and verify said OK. The check at close now compares
    each wrapped module's name with where the model holds it: both are listed, verify fails."""
    model = Chain(3)
    d = fastdump.attach(model, tmp_path)
    mods = model.layers._modules
    mods["0"], mods["1"] = mods["1"], mods["0"]
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)
        first = model.layers[0](x)
    stats = d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert not same_bits(dumped["layers.0"], first)  # (what the check is for: the names are crossed)
    assert sorted(entry.split(":")[0] for entry in stats["modules_not_followed"]) == ["layers.0", "layers.1"]
    assert "holds it as layers.1 now" in stats["modules_not_followed"][0]
    problems = verify_dump(str(tmp_path)).problems
    assert len(problems) == 1 and "could not follow" in problems[0] and "layers.0: " in problems[0]


class Block(nn.Module):
    """A Linear, then ``extra`` when one was put in."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x = self.lin(x)
        return self.extra(x) if "extra" in self._modules else x


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.block = Block()

    def forward(self, x):
        x = self.block(x)
        return self.other(x) if "other" in self._modules else x


def test_a_module_replaced_then_put_back_elsewhere_names_what_is_registered_in_it_by_its_new_place(tmp_path, kind):
    """``old = model.block; model.block = Block(); model.other = old; old.extra = Linear``: the
    Dumper's map of module -> name kept ``block`` for the replaced module, so the Linear put into
    it was dumped as ``block.extra`` (the name of nothing) instead of ``other.extra``, verify OK.
    A module leaving its place forgets that name; one put back takes its new one."""
    model = TwoBlocks()
    d = fastdump.attach(model, tmp_path)
    old = model.block
    model.block = Block()
    model.other = old
    old.extra = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x)
        want = {"block.lin": model.block.lin(x)}
        want["other.lin"] = old.lin(want["block.lin"])
        want["other.extra"] = old.extra(want["other.lin"])
    _closed_with_exactly(d, tmp_path, want, "TwoBlocks", out)


def test_a_replaced_module_given_a_submodule_outside_the_model_is_not_dumped_under_its_old_place(tmp_path, kind):
    """A module replaced and kept outside the model (run by hand) is given a submodule: under the
    stale name its old place had, the submodule was wrapped as ``block.extra`` and its calls
    dumped so (inside the model's pass, beside its own). Now the module has no name in the model
    and nothing registered in it is wrapped."""
    model = TwoBlocks()
    d = fastdump.attach(model, tmp_path)
    old = model.block
    model.block = Block()
    old.extra = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        d.begin_pass()
        model(x)
        old(x)  # outside the model, inside its pass: not the model's, not dumped
        d.end_pass()
        want = model.block.lin(x)
    stats = d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert sorted(dumped) == ["TwoBlocks", "block.lin"] and same_bits(dumped["block.lin"], want)
    assert "forward" not in old.extra.__dict__
    assert stats["modules_not_followed"] == [] and verify_dump(str(tmp_path)).problems == []


RACING_EDITS = {
    "append": lambda model: model.layers.append(nn.Linear(4, 4)),
    "replace": lambda model: model.layers.__setitem__(0, nn.Linear(4, 4)),
    "reordered": lambda model: setattr(model, "layers", nn.ModuleList(list(model.layers)[::-1])),
}


@pytest.mark.parametrize("edit", sorted(RACING_EDITS))
def test_a_module_registered_on_another_thread_while_attach_walks_the_model_is_dumped(tmp_path, kind, monkeypatch, edit):
    """Another thread registers a module after attach's selection walk and before its registration
    hook is in: attach walked the model for its names after wrapping, so the newcomer counted as
    seen: never wrapped, never dumped, and the check at close (which trusts those names) said
    nothing: verify OK. The names are walked first now and the newcomers caught up with once the
    hook is in: dumped under the names they took, bit for bit, each wrapped once."""
    import threading

    model = Chain(2)
    real_select = following_mod.select_modules
    raced = []

    def select_then_race(*args, **kwargs):
        selected = real_select(*args, **kwargs)
        if not raced:
            raced.append(True)
            thread = threading.Thread(target=RACING_EDITS[edit], args=(model,))
            thread.start()
            thread.join()
        return selected

    monkeypatch.setattr("fastdump.capture.following.select_modules", select_then_race)
    d = fastdump.attach(model, tmp_path)
    assert raced
    out, want = _chain_outputs(model, torch.randn(2, 4))
    _closed_with_exactly(d, tmp_path, want, "Chain", out)
    for module in model.modules():
        assert "forward" not in module.__dict__, module


class Relus(nn.Module):
    """A ReLU, then ``extra`` when one was put in: nothing in it is a Linear."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.act(x)
        return self.extra(x) if "extra" in self._modules else x


def test_a_module_taken_out_unseen_then_put_back_elsewhere_names_what_is_registered_in_it_by_its_new_place(
        tmp_path):
    """``del model._modules["block"]`` (no hook sees it) leaves the Dumper's name ``block`` for that
    module; put back as ``model.other`` it is no longer at ``block``, so that name is stale and the
    Linear registered in it afterwards is ``other.extra``. (A mutant reading every earlier name as
    still held kept ``block`` and dumped ``block.extra``, the name of nothing.)"""
    model = TwoBlocks()
    model.block = Relus()
    d = fastdump.attach(model, tmp_path, module_types=[nn.Linear])
    old = model.block
    del model._modules["block"]
    model.block = Relus()
    model.other = old
    old.extra = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x)
        want = {"other.extra": old.extra(model.other.act(model.block(x)))}
    stats = d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert sorted(dumped) == sorted(want)
    assert same_bits(dumped["other.extra"], want["other.extra"]) and same_bits(out, want["other.extra"])
    assert stats["modules_not_followed"] == [] and verify_dump(str(tmp_path)).problems == []


class Pair(nn.Module):
    """A Linear registered as ``0`` (run when still there); returns a tuple, whose first part is
    named ``<name>.0``: the Linear's name while it is in."""

    def __init__(self):
        super().__init__()
        self.add_module("0", nn.Linear(4, 4))

    def forward(self, x):
        h = self._modules["0"](x) if "0" in self._modules else x
        return h, x * 2


def test_a_removed_module_s_name_is_free_for_an_output_part_that_reads_as_it(tmp_path):
    """``delattr(pair, "0")`` frees the name ``m.0``: the first part of the watched ``m``'s tuple
    output is dumped under it. (A mutant that kept the removed module's name among the module
    names skipped that part as "reads as a module's name".)"""
    model = nn.Module()
    model.m = Pair()
    model.forward = lambda x: model.m(x)
    d = fastdump.attach(model, tmp_path)
    d.watch(model.m, "m")
    delattr(model.m, "0")
    x = torch.randn(2, 4)
    with torch.no_grad():
        d.begin_pass()
        out = model.m(x)
        d.end_pass()
    stats = d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert sorted(dumped) == ["m.0", "m.1"]
    assert same_bits(dumped["m.0"], out[0]) and same_bits(dumped["m.1"], out[1])
    assert stats["skipped"] == 0 and verify_dump(str(tmp_path)).problems == []


class Stack(nn.Module):
    """Its ``layers`` in order (Blocks, or whatever replaced them)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_module_moved_out_of_its_moved_parent_takes_its_own_new_name(tmp_path):
    """``model.layers = ModuleList([first.lin, second, first])``: ``first`` moves to ``layers.2``
    and its ``lin``, held now at ``layers.0`` before it, takes that first name (as at attach), not
    ``layers.2.lin`` that its parent's move alone would give it. Named as a Dumper attached after
    the change names them, bit for bit. (A mutant picking the least specific move survived.)"""
    model = Stack()
    d = fastdump.attach(model, tmp_path / "during")
    first, second = model.layers
    model.layers = nn.ModuleList([first.lin, second, first])
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x)
    d.close()
    after = fastdump.attach(model, tmp_path / "after")
    with torch.no_grad():
        model(x)
    after.close()
    during = fastdump.open(tmp_path / "during").load("target", 0, 0)
    reference = fastdump.open(tmp_path / "after").load("target", 0, 0)
    assert sorted(during) == sorted(reference) == ["Stack", "layers.0", "layers.0#1", "layers.1.lin"]
    for name, value in reference.items():
        assert same_bits(during[name], value), name
    assert same_bits(during["Stack"], out)
    assert verify_dump(str(tmp_path / "during")).problems == []


class Places(nn.Module):
    """Runs what it holds at ``block``, then at ``other`` (either may be missing, or one module)."""

    def forward(self, x):
        for place in ("block", "other"):
            if place in self._modules:
                x = self._modules[place](x)
        return x


def _places_outputs(model, x) -> tuple:
    """Places' output and, computed undumped, what each leaf name should hold (a module held twice
    is named by its first place, its second call ``#1``)."""
    want, seen = {}, {}
    with torch.no_grad():
        out = model(x)
        h = x
        for place in ("block", "other"):
            block = model._modules.get(place)
            if block is None:
                continue
            first = seen.setdefault(id(block), place)
            suffix = "" if first == place else "#1"
            h = want[f"{first}.lin{suffix}"] = block.lin(h)
            if "extra" in block._modules:
                h = want[f"{first}.extra{suffix}"] = block.extra(h)
    return out, want


def test_a_removed_module_still_held_elsewhere_names_what_is_registered_in_it_by_that_place(tmp_path):
    """``model.other.block = model.block; del model.block; model.other.block.extra = Linear``: the
    module left one place but another container holds it, which names it now: ``other.block.extra``
    is dumped. (A mutant that forgot every name of a removed module left the Linear unwrapped,
    missing from the dump.)"""
    model = Places()
    model.block = Block()
    model.other = Places()
    model.other.block = model.block
    d = fastdump.attach(model, tmp_path)
    delattr(model, "block")
    kept = model.other.block
    kept.extra = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x)
        want = {"other.block.lin": kept.lin(x)}
        want["other.block.extra"] = kept.extra(want["other.block.lin"])
    _closed_with_exactly(d, tmp_path, want, "Places", out)


def test_a_removed_module_given_a_submodule_outside_the_model_is_not_dumped_under_its_old_place(tmp_path):
    """``old = model.block; del model.block; old.extra = Linear``, ``old`` run by hand inside a pass:
    it has no name in the model, so nothing registered in it is wrapped. (A mutant that kept the
    removed module's names wrapped the Linear as ``block.extra`` and dumped it.)"""
    model = Places()
    model.block = Block()
    d = fastdump.attach(model, tmp_path)
    old = model.block
    delattr(model, "block")
    old.extra = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        d.begin_pass()
        out = model(x)
        old(x)  # outside the model, inside its pass: not the model's, not dumped
        d.end_pass()
    _closed_with_exactly(d, tmp_path, {}, "Places", out)
    assert "forward" not in old.extra.__dict__


def test_a_module_held_twice_replaced_at_its_second_place_keeps_its_first_name(tmp_path):
    """``model.other = model.block; model.other = Block()``: the module left ``other`` but is still
    ``block``, the name it had; a Linear registered in it later is ``block.extra``. (A mutant that
    forgot every name of a replaced module, not only those under the replaced place, left the Linear
    unwrapped, missing from the dump.)"""
    model = Places()
    model.block = Block()
    model.other = model.block
    d = fastdump.attach(model, tmp_path)
    model.other = Block()
    model.block.extra = nn.Linear(4, 4)
    out, want = _places_outputs(model, torch.randn(2, 4))
    assert sorted(want) == ["block.extra", "block.lin", "other.lin"]
    _closed_with_exactly(d, tmp_path, want, "Places", out)


class ShadowedForward(nn.Module):
    """Its class's forward is a property: fastdump cannot wrap it, but dumps its submodules. Runs
    ``lin``, then ``inner`` when one was put in."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @property
    def forward(self):
        def run(x):
            x = self.lin(x)
            return self._modules["inner"](x) if "inner" in self._modules else x
        return run


def test_a_direct_write_into_a_module_with_a_shadowed_forward_makes_verify_fail(tmp_path):
    """A module whose forward is a property is left unwrapped, its submodules are dumped; a Linear
    written into its ``_modules`` after attach (no hook sees it) was not dumped, and the check at
    close skipped everything under the unwrapped module's name: the output silently missing,
    verify OK. It is reported now and verify fails naming it."""
    model = nn.Sequential()
    model.add_module("s", ShadowedForward())
    d = fastdump.attach(model, tmp_path)
    model.s._modules["inner"] = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x)
        lin = model.s.lin(x)
    stats = d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert sorted(dumped) == ["Sequential", "s.lin"]
    assert same_bits(dumped["s.lin"], lin) and same_bits(dumped["Sequential"], out)
    assert [entry.split(":")[0] for entry in stats["modules_not_followed"]] == ["s.inner"]
    problems = verify_dump(str(tmp_path)).problems
    assert len(problems) == 1 and "could not follow" in problems[0] and "s.inner: " in problems[0]
