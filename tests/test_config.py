"""FASTDUMP_* environment flag: parsing, one clear error per bad value, maybe_attach."""

import dataclasses
import json

import pytest
import torch

import fastdump
from fastdump import config
from fastdump.config import ConfigError, env_table, maybe_attach, parse_env, settings_from_env
from fastdump.options import Options
from conftest import doc_example


def test_unset_means_off():
    assert settings_from_env({}) is None
    assert settings_from_env({"FASTDUMP_DIR": "", "FASTDUMP_EVERY": "0"}) is None  # not even parsed


def test_parses_every_variable():
    env = {
        "FASTDUMP_DIR": "/d", "FASTDUMP_ROLE": "draft", "FASTDUMP_LAYERS": "0, 1,5-7,3",
        "FASTDUMP_INCLUDE": r"mlp\.", "FASTDUMP_EXCLUDE": "act_fn$", "FASTDUMP_MODULE_TYPES": "Linear,RMSNorm",
        "FASTDUMP_INPUTS": "TRUE", "FASTDUMP_SKIP": "2", "FASTDUMP_EVERY": "10", "FASTDUMP_PASSES": "5:9",
        "FASTDUMP_MAX_MB": "1.5", "FASTDUMP_POLICY": "drop", "FASTDUMP_WRITER": "thread",
        "FASTDUMP_WRITER_PRIORITY": "normal", "FASTDUMP_RING_MB": "64", "FASTDUMP_DEVICE_RING_MB": "32", "FASTDUMP_SEGMENT_PASSES": "8",
        "FASTDUMP_SEGMENT_MB": "16", "FASTDUMP_SEGMENT_SECONDS": "2.5", "FASTDUMP_STRICT": "1",
        "FASTDUMP_TP_RANK": "1", "FASTDUMP_TP_SIZE": "2", "FASTDUMP_PP_RANK": "0", "FASTDUMP_PP_SIZE": "1",
    }
    assert settings_from_env(env) == {
        "root": "/d", "role": "draft", "layers": (0, 1, 3, 5, 6, 7), "include": r"mlp\.", "exclude": "act_fn$",
        "module_types": ("Linear", "RMSNorm"), "inputs": True, "skip_passes": 2, "every": 10,
        "pass_range": (5, 9), "max_bytes": 3 << 19, "policy": "drop", "writer": "thread", "writer_priority": "normal", "ring_mb": 64.0,
        "device_ring_mb": 32.0, "segment_passes": 8, "segment_mb": 16.0, "segment_seconds": 2.5,
        "strict": True, "tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 1,
    }
    assert settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_PASSES": ":4", "FASTDUMP_MAX_BYTES": "0",
                              "FASTDUMP_INPUTS": "off"}) == \
        {"root": "/d", "pass_range": (0, 4), "max_bytes": 0, "inputs": False}


@pytest.mark.parametrize("var,value", [
    ("FASTDUMP_EVERY", "0"), ("FASTDUMP_EVERY", "often"), ("FASTDUMP_SKIP", "-1"), ("FASTDUMP_LAYERS", "3-1"),
    ("FASTDUMP_LAYERS", "a"), ("FASTDUMP_LAYERS", ","), ("FASTDUMP_INCLUDE", "mlp("), ("FASTDUMP_EXCLUDE", "*"),
    ("FASTDUMP_INPUTS", "maybe"), ("FASTDUMP_PASSES", "9:5"), ("FASTDUMP_PASSES", "7"),
    ("FASTDUMP_PASSES", "5:5"), ("FASTDUMP_ROLE", "fastdump.roles"),
    ("FASTDUMP_MAX_MB", "-1"), ("FASTDUMP_POLICY", "fast"), ("FASTDUMP_WRITER", "fork"),
    ("FASTDUMP_WRITER_PRIORITY", "low"),
    ("FASTDUMP_SEGMENT_SECONDS", "nan"), ("FASTDUMP_RING_MB", "inf"), ("FASTDUMP_ROLE", "../x"),
    ("FASTDUMP_MODULE_TYPES", "nn.Linear"),
    # Parsed, then refused by attach with a message naming ring_mb/root, not the variable:
    ("FASTDUMP_RING_MB", "0.1"), ("FASTDUMP_RING_MB", "0.25"), ("FASTDUMP_DIR", " "), ("FASTDUMP_DIR", "\t"),
    # FASTDUMP_DIR=$(cat file): the dump went to a directory named 'dump\n', where no one looks
    ("FASTDUMP_DIR", "/tmp/dump\n"), ("FASTDUMP_DIR", " /tmp/dump"),
    # an env file's or quoted '~/dump', '$HOME/dump': the dump went to ./~/dump, ./$HOME/dump
    ("FASTDUMP_DIR", "~/dump"), ("FASTDUMP_DIR", "$HOME/dump"), ("FASTDUMP_DIR", "/data/${RUN}/dump"),
    # attach refused these with 'rank.tp_size is 100000, expected an integer 1..65536', no variable named
    ("FASTDUMP_TP_SIZE", "100000"), ("FASTDUMP_PP_SIZE", "99999999999999999999"), ("FASTDUMP_TP_RANK", "65536"),
    # attach took these; the dump then failed with pybind11's "incompatible constructor arguments"
    ("FASTDUMP_RING_MB", "1e26"), ("FASTDUMP_DEVICE_RING_MB", "1e26"), ("FASTDUMP_GRAPH_RING_MB", "1e26"),
    ("FASTDUMP_ROLE", "r" * 256),  # longer than a directory name may be: mkdir failed after attach
    # A zero that would parse to something else: MAX_MB=0 as a 1-byte budget (max(1, 0 MiB)), a
    # 3:3 pass range as one that dumps no pass at all.
    ("FASTDUMP_MAX_MB", "0"), ("FASTDUMP_BLOCK_TIMEOUT_S", "0"), ("FASTDUMP_PASSES", "3:3"),
    # an open end ('diff --passes 7-' takes one) names no layer list: not read as 'to the last layer'
    ("FASTDUMP_LAYERS", "7-"), ("FASTDUMP_LAYERS", "0,7-"),
])
def test_one_clear_error(var, value):
    with pytest.raises(ConfigError) as e:
        settings_from_env({"FASTDUMP_DIR": "/d", var: value})
    assert str(e.value).startswith(f"{var}={value!r}: ") and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


ODD_VALUES = ["", " ", "-1", "0", "0.1", "0.25", "1", "1e3", "0x10", "1_000", "true", "yes", "5e-324",
              "99999999999999999999999999", "1e300", "\u0663", "0:1", "drop", "thread", "Linear", "0-3", "a\x00b"]


@pytest.mark.parametrize("var", [v.name for v in config.ENV_VARS])
def test_every_value_a_variable_takes_attach_takes(var):
    """A value parse_env accepts must be one attach accepts: FASTDUMP_RING_MB=0.1 parsed, then
    maybe_attach raised 'ring_mb must be ... > 0.25', naming no variable."""
    for raw in ODD_VALUES:
        try:
            settings = parse_env({var: raw})
        except ConfigError as e:
            assert str(e).startswith(f"{var}={raw!r}: ")
            continue
        settings.setdefault("root", ".")
        Options(**settings)


def test_maybe_attach_names_the_variable_attach_would_refuse(tmp_path):
    with pytest.raises(ConfigError, match=r"^FASTDUMP_RING_MB='0\.2': ring_mb must be"):
        maybe_attach(Boom(), environ={"FASTDUMP_DIR": str(tmp_path), "FASTDUMP_RING_MB": "0.2"})
    with pytest.raises(ConfigError, match=r"^FASTDUMP_DIR='  ': "):
        maybe_attach(Boom(), environ={"FASTDUMP_DIR": "  "})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("var,value", [
    ("FASTDUMP_NO_DIRECT_IO", "maybe"), ("FASTDUMP_CUDA_CHECK_EACH_TENSOR", "true"), ("FASTDUMP_CUDA_BATCH", "no"),
    ("FASTDUMP_CUDA_EVENTS_EVERY", "1e3"), ("FASTDUMP_CUDA_REGISTER_PIECE_MB", "0x10"), ("FASTDUMP_CUDA_HOLD_MS", "0"),
    ("FASTDUMP_CUDA_HOLD_MS", "inf"), ("FASTDUMP_TORCH_READER", "false"), ("FASTDUMP_EXIT_TIMEOUT_S", "-1"),
    ("FASTDUMP_CUDA_EVENTS_EVERY", "0"), ("FASTDUMP_CUDA_REGISTER_PIECE_MB", "0"),  # (counts: at least 1)
])
def test_a_variable_read_elsewhere_that_its_reader_would_misread_is_refused(var, value):
    """The CUDA stager reads its flags by their first character and its numbers with atoll/atof:
    FASTDUMP_CUDA_CHECK_EACH_TENSOR=true was off and FASTDUMP_CUDA_EVENTS_EVERY=1e3 was 1, silently."""
    with pytest.raises(ConfigError) as e:
        settings_from_env({"FASTDUMP_DIR": "/d", var: value})
    assert str(e.value).startswith(f"{var}={value!r}: ")
    for good in ("1", "0") if var != "FASTDUMP_CUDA_HOLD_MS" else ("0.5", "2"):
        if not (good == "0" and var in ("FASTDUMP_CUDA_EVENTS_EVERY", "FASTDUMP_CUDA_REGISTER_PIECE_MB")):
            assert settings_from_env({"FASTDUMP_DIR": "/d", var: good}) == {"root": "/d"}
    assert settings_from_env({"FASTDUMP_DIR": "/d", var: ""}) == {"root": "/d"}  # empty: unset, as its reader takes it


@pytest.mark.parametrize("entry", ["attach", "Dumper", "maybe_attach"])
@pytest.mark.parametrize("var,value", [
    ("FASTDUMP_CUDA_HOLD_MS", "abc"), ("FASTDUMP_CUDA_EVENTS_EVERY", "1e3"), ("FASTDUMP_CUDA_BATCH", "true"),
    ("FASTDUMP_CUDA_REGISTER_PIECE_MB", "0x10"), ("FASTDUMP_CUDA_CHECK_EACH_TENSOR", "yes"),
    ("FASTDUMP_NO_DIRECT_IO", "maybe"),
])
def test_every_entry_refuses_a_runtime_variable_its_reader_would_misread(tmp_path, monkeypatch, entry, var, value):
    """Only maybe_attach and `fastdump info` checked these: a direct fastdump.attach() took
    FASTDUMP_CUDA_HOLD_MS=abc and the C++ stager read it (atof) as 0, silently."""
    from fastdump.capture import Dumper, resolve_ranks

    monkeypatch.setenv(var, value)
    root = tmp_path / "dump"
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as e:
        if entry == "attach":
            fastdump.attach(model, root)
        elif entry == "Dumper":
            opts = Options(root=str(root))
            Dumper(model, opts, ranks=resolve_ranks(**opts.rank_args))
        else:
            maybe_attach(model, environ={"FASTDUMP_DIR": str(root), var: value})
    assert str(e.value).startswith(f"{var}={value!r}: ")
    assert not root.exists()  # refused before anything was made


def test_dump_roots_with_odd_characters_are_taken_as_given():
    for root in ("/tmp/a b/c", "/tmp/caf\u00e9/\u6f22", "/tmp/x~y", "/tmp/price$", "/tmp/a$1"):
        assert settings_from_env({"FASTDUMP_DIR": root}) == {"root": root}


def test_a_rank_outside_its_size_names_both_variables():
    with pytest.raises(ConfigError, match=r"^FASTDUMP_TP_RANK='2': must be below FASTDUMP_TP_SIZE='2'$"):
        settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_TP_RANK": "2", "FASTDUMP_TP_SIZE": "2"})
    with pytest.raises(ConfigError, match=r"^FASTDUMP_PP_RANK='3': must be below FASTDUMP_PP_SIZE='1'$"):
        settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_PP_RANK": "3", "FASTDUMP_PP_SIZE": "1"})
    assert settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_TP_RANK": "1", "FASTDUMP_TP_SIZE": "2"}) == \
        {"root": "/d", "tp_rank": 1, "tp_size": 2}


def test_conflicting_budgets():
    with pytest.raises(ConfigError, match="FASTDUMP_MAX_MB='1'.*only one"):
        settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_MAX_BYTES": "10", "FASTDUMP_MAX_MB": "1"})


def test_unknown_variable_warns():
    with pytest.warns(UserWarning, match="FASTDUMP_LAYER .*FASTDUMP_LAYERS"):
        settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_LAYER": "1"})


def test_a_misspelt_variable_is_warned_about_by_a_direct_attach_too(tmp_path, monkeypatch, recwarn):
    """Only maybe_attach warned: `FASTDUMP_NO_DIRECTIO=1` (or `FASTDUMP_EXIT_TIMEOUT=5`) with
    fastdump.attach() was ignored without a word. Now every attach warns, once per name and
    process, at the caller's line, naming the variable meant (runtime variables included)."""
    monkeypatch.setattr(config, "_WARNED_UNKNOWN", set(), raising=False)
    monkeypatch.setenv("FASTDUMP_NO_DIRECTIO", "1")
    model = torch.nn.Linear(2, 2)
    for _ in range(2):
        fastdump.attach(model, tmp_path / "d", writer="thread").close()
    warned = [w for w in recwarn if "unknown environment variable" in str(w.message)]
    assert [str(w.message) for w in warned] == [
        "unknown environment variable FASTDUMP_NO_DIRECTIO (did you mean FASTDUMP_NO_DIRECT_IO?); ignored"]
    assert warned[0].filename == __file__
    recwarn.clear()
    monkeypatch.delenv("FASTDUMP_NO_DIRECTIO")
    monkeypatch.setenv("FASTDUMP_DIR", str(tmp_path / "e"))  # maybe_attach warns (its parse_env), attach not again
    monkeypatch.setenv("FASTDUMP_EVRY", "2")
    maybe_attach(model).close()
    warned = [w for w in recwarn if "unknown environment variable" in str(w.message)]
    assert [str(w.message) for w in warned] == [
        "unknown environment variable FASTDUMP_EVRY (did you mean FASTDUMP_EVERY?); ignored"]
    assert warned[0].filename == __file__  # (it named fastdump/__init__.py)


def test_variables_read_elsewhere_are_not_reported_as_misspelt(recwarn):
    assert settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_NO_DIRECT_IO": "1", "FASTDUMP_CUDA": "0"}) == {"root": "/d"}
    assert not [w for w in recwarn if "unknown environment variable" in str(w.message)]


def test_every_variable_the_code_reads_is_known(recwarn):
    """The CUDA stager's FASTDUMP_CUDA_* tuning variables (docs/CUDA.md) were warned about as
    'unknown environment variable ...; ignored' by maybe_attach, and missing from `fastdump info`,
    though the stager reads them."""
    import pathlib
    import re

    repo = pathlib.Path(__file__).resolve().parent.parent
    read = set()
    # (tests/cuda_mock too: the mock runtime's FASTDUMP_MOCK_SEED, which docs/CUDA.md tells developers to
    # set, was warned about as "unknown ... ignored" at every attach, and failed the misspelling test.)
    for path in [repo / "setup.py", *(repo / "fastdump").rglob("*.py"), *(repo / "csrc").glob("*.*"),
                 *(repo / "tests" / "cuda_mock").glob("*.*")]:
        text = path.read_text(errors="replace")
        read |= set(re.findall(r'(?:getenv|environ\.get|environ\[)\(?"(FASTDUMP_[A-Z0-9_]+)"', text))
    assert {"FASTDUMP_CUDA_HOLD_MS", "FASTDUMP_CUDA_BATCH", "FASTDUMP_NO_DIRECT_IO"} <= read  # (the scan works)
    known = {v.name for v in config.ENV_VARS} | set(config.OTHER_VARS)
    assert read - known == set()
    settings_from_env({"FASTDUMP_DIR": "/d", **{name: "1" for name in config.OTHER_VARS}})
    assert not [w for w in recwarn if "unknown environment variable" in str(w.message)]


def test_env_table_covers_attach():
    rows = env_table()
    assert {r["name"] for r in rows} == {v.name for v in config.ENV_VARS}
    assert all(r["doc"] and r["format"] for r in rows)
    params = {f.name: f for f in dataclasses.fields(Options)}
    assert all(r["kwarg"] in params for r in rows)
    by_name = {r["name"]: r for r in rows}
    assert by_name["FASTDUMP_EVERY"]["default"] == params["every"].default == 1  # the option's own default


class Boom(torch.nn.Module):
    """Any access to the model would be a bug when the flag is off or invalid."""

    def __getattr__(self, name):
        raise AssertionError(f"model touched: {name}")


def test_maybe_attach_off_touches_nothing():
    assert maybe_attach(Boom(), environ={}) is None


def test_maybe_attach_validates_before_touching_model(tmp_path):
    with pytest.raises(ConfigError, match="FASTDUMP_EVERY"):
        maybe_attach(Boom(), environ={"FASTDUMP_DIR": str(tmp_path), "FASTDUMP_EVERY": "0"})
    with pytest.raises(TypeError, match="evry"):
        maybe_attach(Boom(), environ={"FASTDUMP_DIR": str(tmp_path)}, evry=2)
    assert not list(tmp_path.iterdir())


def test_maybe_attach_precedence(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    env = {"FASTDUMP_DIR": str(tmp_path), "FASTDUMP_ROLE": "envrole", "FASTDUMP_EVERY": "2",
           "FASTDUMP_WRITER": "thread", "FASTDUMP_INCLUDE": "^0$"}
    d = maybe_attach(model, environ=env, every=1)  # code beats environment
    assert d.role == "envrole"  # no role in code: FASTDUMP_ROLE
    with torch.no_grad():
        for _ in range(3):
            model(torch.ones(1, 4))
    d.close()
    ds = fastdump.open(tmp_path)
    rank = ds.ranks("envrole")[0]
    assert ds.passes("envrole", rank) == [0, 1, 2]
    assert set(ds.load("envrole", rank, 0)) == {"0"}
    d = maybe_attach(model, role="draft", environ=env)  # code's role beats FASTDUMP_ROLE
    assert d.role == "draft"
    d.close()


def test_docs_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FASTDUMP_DIR", raising=False)
    exec(compile(doc_example("config"), "INTEGRATIONS.md:config", "exec"), ns := {})
    assert ns["dumper"] is None and not list(tmp_path.iterdir())
    monkeypatch.setenv("FASTDUMP_DIR", "dump")
    exec(compile(doc_example("config"), "INTEGRATIONS.md:config", "exec"), ns := {})
    ds = fastdump.open("dump")
    rank = ds.ranks("target")[0]
    assert ds.passes("target", rank) == [0]
    assert torch.equal(ds.load("target", rank, 0)["1"], torch.relu(ns["model"][0](torch.ones(2, 8))).detach())


def test_a_huge_layer_range_is_refused_not_expanded():
    """FASTDUMP_LAYERS=0-100000000 took 35 s and GBs to parse (a set of every index); one more zero
    ran the server out of memory at start-up."""
    import time

    start = time.monotonic()
    with pytest.raises(ConfigError, match="FASTDUMP_LAYERS.*up to"):
        parse_env({"FASTDUMP_LAYERS": "0-10000000000"})
    assert time.monotonic() - start < 1
    assert parse_env({"FASTDUMP_LAYERS": "0-3,1048575"})["layers"] == (0, 1, 2, 3, 1048575)


def test_fastdump_info_checks_the_variables_set(monkeypatch, capsys):
    """`fastdump info` listed the variables but not the values set: an operator checking the flag
    before a run was told nothing about FASTDUMP_EVERY=0 (exit 0)."""
    from fastdump.cli.main import main as cli_main

    for key in [k for k in __import__("os").environ if k.startswith("FASTDUMP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("FASTDUMP_DIR", "/tmp/d")
    monkeypatch.setenv("FASTDUMP_EVERY", "0")
    assert cli_main(["info"]) == 1
    out = capsys.readouterr().out
    assert "  FASTDUMP_EVERY='0'\n" in out and "ERROR: FASTDUMP_EVERY='0': must be an integer >= 1\n" in out
    assert cli_main(["info", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["environment_now"]["error"] == "FASTDUMP_EVERY='0': must be an integer >= 1"
    monkeypatch.setenv("FASTDUMP_EVERY", "2")
    monkeypatch.setenv("FASTDUMP_EVRY", "3")
    assert cli_main(["info"]) == 0
    out = capsys.readouterr().out
    assert "warning: unknown environment variable FASTDUMP_EVRY (did you mean FASTDUMP_EVERY?); ignored" in out
    assert "ERROR" not in out


def test_fastdump_info_lists_every_variable_in_one_column(capsys):
    """Names longer than the 26 columns reserved (FASTDUMP_SEGMENT_IDLE_SECONDS) ran into their
    description; every description now starts in one column, one space after the longest name."""
    from fastdump.cli.main import main as cli_main

    cli_main(["info"])
    out = capsys.readouterr().out
    rows = [line for line in out.split("set in this environment")[0].splitlines() if line.startswith("  FASTDUMP_")]
    assert len(rows) > 30 and any("FASTDUMP_SEGMENT_IDLE_SECONDS" in row for row in rows)
    width = max(len(row.split()[0]) for row in rows)
    for row in rows:
        name = row.split()[0]
        assert row[2 + width] == " " and row[3 + width] != " ", row
        assert row[2:2 + width].rstrip() == name, row


def test_a_selection_that_matches_no_module_is_said(tmp_path, caplog):
    """FASTDUMP_MODULE_TYPES=Linaer (or an INCLUDE no name matches): every pass was recorded with no
    tensor, and nothing said why."""
    import logging

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    env = {"FASTDUMP_DIR": str(tmp_path / "a"), "FASTDUMP_WRITER": "thread", "FASTDUMP_MODULE_TYPES": "Linaer"}
    with caplog.at_level(logging.WARNING, logger="fastdump"):
        maybe_attach(model, environ=env).close()
    assert "the selection module_types=('Linaer',) matches no module of the model" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastdump"):
        d = maybe_attach(model, environ=dict(env, FASTDUMP_DIR=str(tmp_path / "b"), FASTDUMP_MODULE_TYPES="Linear"))
        with torch.inference_mode():
            out = model[0](torch.ones(1, 4))
            model(torch.ones(1, 4))
        d.close()
    assert "matches no module" not in caplog.text
    assert torch.equal(fastdump.open(tmp_path / "b").load("target", 0, 0)["0"], out)


def test_a_misspelt_option_keyword_names_the_option_meant(tmp_path, monkeypatch):
    """attach(model, root, evry=2) said "Options.__init__() got an unexpected keyword argument
    'evry'"; maybe_attach(model, evry=2) said nothing until FASTDUMP_DIR was set (in production)."""
    model = torch.nn.Linear(2, 2)
    expected = ("unknown option(s) 'evry' (did you mean 'every'?), 'zzz'; the options are listed in README.md "
                "(Use) and fastdump/options.py")
    with pytest.raises(TypeError) as caught:
        fastdump.attach(model, tmp_path, evry=2, zzz=1)
    assert str(caught.value) == f"attach: {expected}" and not list(tmp_path.iterdir())
    monkeypatch.delenv("FASTDUMP_DIR", raising=False)
    with pytest.raises(TypeError) as caught:
        fastdump.maybe_attach(model, evry=2, zzz=1)
    assert str(caught.value) == f"maybe_attach: {expected}"
    assert fastdump.maybe_attach(model, every=2) is None


def test_a_budget_of_a_few_bytes_in_mib_is_at_least_one_byte():
    """FASTDUMP_MAX_MB > 0 is never read as a budget of 0 bytes: a fraction of a byte is the 1-byte
    budget (options._mb_to_bytes)."""
    assert settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_MAX_MB": "1e-9"})["max_bytes"] == 1
    assert settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_MAX_MB": "1.5"})["max_bytes"] == 3 << 19


def test_a_switch_set_empty_is_off():
    """FASTDUMP_STRICT= (set, empty: an env file's blank line) is off, as the documented 0/false."""
    assert settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_STRICT": ""})["strict"] is False
    assert settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_STRICT": " On "})["strict"] is True


def test_the_largest_rank_and_size_variables_are_taken():
    """FASTDUMP_TP_SIZE/PP_SIZE go up to format.MAX_PARALLEL_SIZE and the ranks to one below it,
    both inclusive (the parser's bounds are the ones attach checks)."""
    from fastdump.format import MAX_PARALLEL_SIZE

    top = str(MAX_PARALLEL_SIZE)
    got = settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_TP_SIZE": top, "FASTDUMP_TP_RANK": str(MAX_PARALLEL_SIZE - 1),
                             "FASTDUMP_PP_SIZE": top, "FASTDUMP_PP_RANK": str(MAX_PARALLEL_SIZE - 1)})
    assert (got["tp_size"], got["tp_rank"], got["pp_size"], got["pp_rank"]) == \
        (MAX_PARALLEL_SIZE, MAX_PARALLEL_SIZE - 1, MAX_PARALLEL_SIZE, MAX_PARALLEL_SIZE - 1)
