"""fastdump.options: every attach option defined once (default, check, variable); the engine-wide
settings decided by the first attach, with a warning for a later attach that differs."""

import dataclasses
import json
import logging

import pytest
import torch

import fastdump
from fastdump import config
from fastdump.options import ENV_VARS, EngineOptions, Options


def test_every_variable_sets_an_option_and_its_parsed_value_passes_the_check(tmp_path):
    samples = {"FASTDUMP_DIR": str(tmp_path), "FASTDUMP_ROLE": "draft", "FASTDUMP_LAYERS": "0,2-3",
               "FASTDUMP_INCLUDE": "mlp", "FASTDUMP_EXCLUDE": "attn", "FASTDUMP_MODULE_TYPES": "Linear",
               "FASTDUMP_INPUTS": "1", "FASTDUMP_SKIP": "2", "FASTDUMP_EVERY": "3", "FASTDUMP_PASSES": "1:9",
               "FASTDUMP_MAX_BYTES": "100", "FASTDUMP_MAX_MB": "1", "FASTDUMP_POLICY": "drop",
               "FASTDUMP_BLOCK_TIMEOUT_S": "0.5", "FASTDUMP_WRITER": "thread", "FASTDUMP_WRITER_PRIORITY": "normal",
               "FASTDUMP_RING_MB": "8", "FASTDUMP_DEVICE_RING_MB": "16",
               "FASTDUMP_CUDA_GRAPHS": "skip", "FASTDUMP_GRAPH_RING_MB": "32", "FASTDUMP_SEGMENT_PASSES": "4",
               "FASTDUMP_SEGMENT_MB": "2", "FASTDUMP_SEGMENT_SECONDS": "3", "FASTDUMP_SEGMENT_IDLE_SECONDS": "0",
               "FASTDUMP_STRICT": "1", "FASTDUMP_TP_RANK": "1", "FASTDUMP_TP_SIZE": "2", "FASTDUMP_PP_RANK": "0",
               "FASTDUMP_PP_SIZE": "1"}
    assert set(samples) == {v.name for v in ENV_VARS}  # a new variable needs a sample here
    fields = {f.name for f in dataclasses.fields(Options)}
    for var in ENV_VARS:
        assert var.kwarg in fields, var.name
        value = var.parse(samples[var.name])
        opts = Options(**{"root": str(tmp_path), var.kwarg: value})  # __post_init__ accepts it
        assert getattr(opts, var.kwarg) == value


@pytest.mark.parametrize("option, value", [
    ("every", 0), ("skip_passes", -1), ("policy", "wait"), ("writer", "fork"), ("writer_priority", "low"),
    ("ring_mb", 0.1), ("device_ring_mb", 0), ("device_ring_mb", float("nan")), ("segment_idle_seconds", -1),
    ("block_timeout_s", True), ("cuda_graphs", "replay"), ("graph_ring_mb", 0), ("pass_range", (5, 2)), ("layers", [-1]), ("role", "a/b"), ("root", ""),
])
def test_bad_values_fail_at_construction_naming_the_option(tmp_path, option, value):
    kwargs = {"root": str(tmp_path), option: value}
    with pytest.raises(ValueError, match=option):
        Options(**kwargs)


@pytest.mark.parametrize("kwarg", [True, False])
def test_an_empty_pass_range_is_refused_naming_the_fix(tmp_path, kwarg):
    """pass_range=(5, 5) (FASTDUMP_PASSES=5:5) was accepted and dumped nothing, without a word:
    stop is exclusive, and the user meant pass 5. Refused at attach, before anything is written,
    saying what to give; the variable through config's ConfigError (the refusal every bad
    FASTDUMP_ value takes, before the model is touched)."""
    from fastdump.config import ConfigError, maybe_attach

    model = torch.nn.Linear(4, 3)
    if kwarg:
        with pytest.raises(ValueError) as info:
            fastdump.attach(model, tmp_path, pass_range=(5, 5))
        assert str(info.value) == ("pass_range (5, 5): stop must be greater than start: [5, 5) holds no pass (stop "
                                   "is exclusive); for pass 5 alone give (5, 6)")
    else:
        with pytest.raises(ConfigError) as info:
            maybe_attach(model, environ={"FASTDUMP_DIR": str(tmp_path), "FASTDUMP_PASSES": "5:5"})
        assert str(info.value) == ("FASTDUMP_PASSES='5:5': stop must be greater than start: [5, 5) holds no pass "
                                   "(stop is exclusive); for pass 5 alone give 5:6")
    assert not list(tmp_path.iterdir()) and type(model.forward).__name__ == "method"  # the model untouched
    with fastdump.attach(model, tmp_path, pass_range=(5, 6), writer="thread"), torch.inference_mode():
        outs = [model(torch.full((2, 4), float(p))) for p in range(7)]
    with fastdump.open(tmp_path) as ds:
        assert ds.passes("target", 0) == [5] and torch.equal(ds.load("target", 0, 5)["Linear"], outs[5])


@pytest.mark.parametrize("role", ["fastdump.json", "fastdump.roles"])
def test_a_role_named_as_fastdumps_own_root_files_is_refused(tmp_path, role):
    with pytest.raises(ValueError, match="a name fastdump uses at the dump root"):
        fastdump.attach(None, tmp_path, role=role)
    assert not list(tmp_path.iterdir())


def test_unknown_option_is_a_type_error_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match="evry"):
        fastdump.attach(None, tmp_path, evry=2)
    assert not list(tmp_path.iterdir())


def test_manifest_config_records_the_options_fastdump_json_always_had(tmp_path):
    d = fastdump.attach(None, tmp_path, layers=(3, 1), include="mlp", every=2, pass_range=(0, 8), writer="thread")
    try:
        written = json.loads((tmp_path / "fastdump.json").read_text())["config"]
    finally:
        d.close()
    assert list(written) == ["role", "layers", "include", "exclude", "module_types", "inputs", "skip_passes",
                             "every", "pass_range", "max_bytes", "policy", "block_timeout_s", "writer",
                             "writer_priority", "ring_mb", "device_ring_mb", "cuda_graphs", "graph_ring_mb",
                             "segment_passes", "segment_mb",
                             "segment_seconds", "segment_idle_seconds"]
    assert written["layers"] == [1, 3] and written["include"] == "mlp" and written["pass_range"] == [0, 8]
    assert written["every"] == 2 and written["writer"] == "thread" and written["module_types"] == []


def test_engine_options_are_the_engine_wide_subset():
    opts = Options(root="/d", ring_mb=8, writer="thread", writer_priority="normal", device_ring_mb=32)
    assert opts.engine == EngineOptions(ring_mb=8, writer="thread", writer_priority="normal", device_ring_mb=32)
    assert EngineOptions().differences(EngineOptions()) == []
    # writer_priority means nothing to a writer thread: no warning for it
    assert EngineOptions(writer="thread").differences(EngineOptions(writer="thread", writer_priority="normal")) == []


def test_a_later_attach_with_another_device_ring_gets_a_warning_and_the_first_setting(tmp_path, caplog):
    """The first attach decides the engine-wide settings; device_ring_mb differences used to be
    ignored without a word."""
    first = fastdump.attach(None, tmp_path, role="a", writer="thread", device_ring_mb=64)
    try:
        with caplog.at_level(logging.WARNING, logger="fastdump"):
            second = fastdump.attach(None, tmp_path, role="b", writer="thread", device_ring_mb=128)
        try:
            assert second._engine is first._engine
            assert first._engine.options.device_ring_mb == 64
            msgs = [r.getMessage() for r in caplog.records if "device_ring_mb" in r.getMessage()]
            assert msgs and "device_ring_mb=64 (asked: 128)" in msgs[0], caplog.text
        finally:
            second.close()
    finally:
        first.close()


def test_a_later_attach_with_the_same_engine_settings_says_nothing(tmp_path, caplog):
    first = fastdump.attach(None, tmp_path, role="a", writer="thread")
    try:
        with caplog.at_level(logging.WARNING, logger="fastdump"):
            second = fastdump.attach(None, tmp_path, role="b", writer="thread")
        second.close()
    finally:
        first.close()
    assert "staging engine already runs" not in caplog.text


def test_integrations_read_the_public_parser():
    assert config.parse_env({"FASTDUMP_EVERY": "4"}) == {"every": 4}
    with pytest.raises(config.ConfigError, match="FASTDUMP_EVERY"):
        config.parse_env({"FASTDUMP_EVERY": "0"})


def test_include_and_exclude_take_a_regex_or_a_list_and_refuse_anything_else_at_attach(tmp_path):
    """A list of patterns was accepted by attach and failed later, after the writer had started."""
    import re

    import torch

    import fastdump

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    x = torch.ones(1, 2)
    for include, want in ((["^0$", "^2$"], {"0", "2"}), (("^1$",), {"1"}), (re.compile("^[01]$"), {"0", "1"}),
                          ([re.compile("^0$"), "^1$"], {"0", "1"})):
        root = tmp_path / f"dump{len(list(tmp_path.iterdir()))}"
        d = fastdump.attach(model, root, include=include, exclude=["Sequential"], strict=True)
        with torch.no_grad():
            model(x)
        d.close()
        got = fastdump.open(root).load("target", 0, 0)
        assert set(got) == want, (include, sorted(got))
        with torch.no_grad():
            outputs = {"0": model[0](x), "1": model[1](model[0](x)), "2": model(x)}
        for name in want:
            assert torch.equal(got[name], outputs[name]), name
    from fastdump.options import Options

    one = re.compile("MLP", re.I)  # a single compiled pattern, alone or in a list, keeps its flags
    assert Options(root=str(tmp_path), include=[one]).include is one
    assert Options(root=str(tmp_path), include=one).include is one
    for bad in ([], [1], 3, ["(unclosed"], "(unclosed", [re.compile("a", re.I), "b"], [b"x"]):
        with pytest.raises(ValueError, match="include"):
            fastdump.attach(model, tmp_path / "bad", include=bad)
    assert not (tmp_path / "bad").exists()
    from fastdump.staging.engine import Engine

    assert Engine._current is None or Engine._current.closed


def _dump_of(tmp_path, **options):
    """A three-layer model run once with ``options``: (its dump's names, {name: output the module returned})."""
    import torch

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = torch.nn.Linear(4, 4), torch.nn.SiLU()

        def forward(self, x):
            return self.act(self.lin(x))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(Layer() for _ in range(3))
    model.forward = lambda x: model.layers[2](model.layers[1](model.layers[0](x)))
    seen = {}
    for name, module in model.named_modules():
        if name.count(".") == 2:
            module.register_forward_hook(lambda m, a, out, name=name: seen.setdefault(name, out.clone()))
    root = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
    d = fastdump.attach(model, root, writer="thread", root_name="root", **options)
    try:
        with torch.no_grad():
            model(torch.randn(2, 4))
    finally:
        d.close()
    got = fastdump.open(root).load("target", 0, 0)
    for name, value in got.items():
        if name != "root":
            assert torch.equal(value, seen[name]), name
    return sorted(got), seen


def test_layers_and_module_types_given_as_an_iterator_a_class_or_a_name_select_what_a_list_does(tmp_path):
    """layers= given as a generator was read up by attach's check: no layer was dumped, without a
    word. module_types="Linear" kept no module (read as its letters), a generator was read up by
    fastdump.json, and module_types=nn.Linear failed while wrapping (dumping off, no error)."""
    import torch

    want, _ = _dump_of(tmp_path, layers=[0, 2])
    assert want == ["layers.0.act", "layers.0.lin", "layers.2.act", "layers.2.lin", "root"]
    assert _dump_of(tmp_path, layers=(i for i in (0, 2)))[0] == want
    assert _dump_of(tmp_path, layers={2, 0})[0] == want
    linears = ["layers.0.lin", "layers.1.lin", "layers.2.lin"]
    for types in ([torch.nn.Linear], ["Linear"], torch.nn.Linear, "Linear", (t for t in [torch.nn.Linear])):
        assert _dump_of(tmp_path, module_types=types)[0] == linears, types
    assert Options(root="/d", layers=iter([3, 1])).layers == (1, 3)
    assert Options(root="/d", module_types="Linear").module_types == ("Linear",)


@pytest.mark.parametrize("option, value", [
    ("layers", 5), ("layers", "0,1"), ("layers", [1 << 20]), ("layers", range(10 ** 12)),
    ("module_types", []), ("module_types", [1]), ("module_types", "nn.Linear"), ("module_types", {"Linear": 1}),
    ("inputs", "false"), ("strict", "no"), ("root_passes", None), ("inputs", 2),
    ("root_name", 5), ("root_name", ""), ("pass_meta", "x"), ("pass_meta", {"mixed": True}),
    ("pass_meta", {"complete": False}), ("device", "cuda:x"), ("device", "banana"), ("device", -1),
    ("device", True), ("device", 1.5),
])
def test_bad_values_of_the_other_options_fail_at_attach_naming_the_option(tmp_path, option, value):
    """Each used to be accepted: taken as true ("false", "no"), ignored ("banana"), or failing later
    (while wrapping or starting: dumping off, no error at attach). pass_meta={"mixed": True} made a
    whole pass read as mixed while `fastdump verify` said OK; set_pass_meta refuses those keys."""
    import time

    import torch

    start = time.monotonic()
    with pytest.raises(ValueError, match=option):
        fastdump.attach(torch.nn.Linear(2, 2), tmp_path / "d", **{option: value})
    assert not (tmp_path / "d").exists()  # before anything was created
    assert time.monotonic() - start < 5  # (range(10**12) is not walked)


def test_good_values_of_the_other_options_are_kept(tmp_path):
    import numpy as np
    import torch

    o = Options(root="/d", inputs=1, strict=np.True_, root_passes=0, pass_meta={"step": 1}, device="cuda:1")
    assert (o.inputs, o.strict, o.root_passes, o.pass_meta) == (True, True, False, {"step": 1})
    for device in (None, 0, 3, "cuda", "cpu", torch.device("cuda", 2), torch.device("cpu")):
        assert Options(root="/d", device=device).device is device


def test_a_role_of_255_bytes_is_a_directory_name_and_is_dumped_under_it(tmp_path):
    """NAME_MAX is 255 bytes: a role of 255 bytes (UTF-8) is a directory name like any other and is
    dumped; 256 bytes are refused at attach (mkdir would fail after it, dumping off)."""
    import torch

    from conftest import same_bits

    role = "é" * 127 + "r"  # 255 bytes, 128 characters
    lin = torch.nn.Linear(2, 2)
    x = torch.randn(1, 2)
    with fastdump.attach(lin, tmp_path, role=role, writer="thread") as d:
        assert d.status == "running", d.error
        with torch.no_grad():
            want = lin(x)
    dumped = fastdump.open(tmp_path).load(role, 0, 0)
    assert list(dumped) == ["Linear"] and same_bits(dumped["Linear"], want)
    with pytest.raises(ValueError, match="at most 255 bytes, not 256"):
        Options(root=str(tmp_path), role="é" * 128)


def test_attach_docstring_and_readme_name_every_option():
    """help(fastdump.attach) said only "see fastdump.options.Options": its docstring and README's
    "Use" now name the options; an option added to Options without them fails here."""
    from pathlib import Path

    doc = fastdump.attach.__doc__
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for f in dataclasses.fields(Options):
        if f.name == "root":
            continue
        group = f.name[:3] + "*" if f.name[:3] in ("dp_", "ep_") else f.name
        assert f"``{group}``" in doc, f.name
        assert f"`{f.name}" in readme or f"{f.name}=" in readme, f.name


@pytest.mark.parametrize("name", ["ring_mb", "device_ring_mb", "graph_ring_mb"])
def test_a_ring_size_of_exactly_the_limit_is_taken_and_one_above_it_refused(name):
    """The ring sizes go up to MAX_RING_MB (4 TiB) inclusive: the limit is refusing typos (1e26),
    not the largest size it names."""
    import math

    from fastdump.options import MAX_RING_MB

    assert getattr(Options(root="/d", **{name: MAX_RING_MB}), name) == MAX_RING_MB
    with pytest.raises(ValueError, match=f"{name} must be at most 4194304 \\(MiB\\)"):
        Options(root="/d", **{name: math.nextafter(MAX_RING_MB, math.inf)})


def test_a_cuda_device_that_names_no_index_is_refused_without_torch_imported_too():
    """device='cuda:x' is refused by torch.device where torch is imported; in a process that has not
    imported it (a config checked before the model is built) the option's own pattern refuses it."""
    import subprocess
    import sys

    code = ("import sys; from fastdump.options import Options\n"
            "assert 'torch' not in sys.modules\n"
            "for bad in ('cuda:x', 'cuda:1a', 'cuda:'):\n"
            "    try:\n"
            "        Options(root='/d', device=bad)\n"
            "    except ValueError as e:\n"
            "        assert 'device must be a CUDA device index' in str(e), e\n"
            "    else:\n"
            "        raise SystemExit(f'{bad!r} taken')\n"
            "assert Options(root='/d', device='cuda:1').device == 'cuda:1'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
