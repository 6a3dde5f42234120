"""The package's import graph: layers in data-flow order, no cycles, no import back up.

Every import counts, the lazy ones inside functions too (they run, just later). A module may import
from its own layer and from the layers it is allowed to see below; docs/INTERNALS.md ("Module map")
names the same layers."""

import ast
from pathlib import Path

import fastdump

PACKAGE = Path(fastdump.__file__).parent

# layer -> module prefixes in it (a prefix ending in "." is a folder)
LAYERS = {
    "base": ("fastdump._C", "fastdump._version", "fastdump.format", "fastdump.dtypes", "fastdump.fsutil",
             "fastdump.options", "fastdump.protocol", "fastdump.devices", "fastdump.segment_list"),
    "writer": ("fastdump.writer",),
    "staging": ("fastdump.staging",),
    "capture": ("fastdump.capture",),
    "read": ("fastdump.reader", "fastdump.multiroot", "fastdump.stats", "fastdump.report", "fastdump.compare",
             "fastdump.rowlog", "fastdump.export"),
    "front": ("fastdump", "fastdump.__main__", "fastdump.config", "fastdump.cli", "fastdump.integrations"),
}
# What each layer may import besides itself. The writer runs in its own process and sees only the
# base; staging starts it (or runs its loop in a thread); the reading side never touches the
# serving side; only the front (public API, flag, CLI, integrations) sees everything.
MAY_IMPORT = {
    "base": set(),
    "writer": {"base"},
    "staging": {"base", "writer"},
    "capture": {"base", "staging"},
    "read": {"base"},
    "front": {"base", "writer", "staging", "capture", "read"},
}


def _modules() -> dict:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imports(name: str, path: Path, is_package: bool, modules: dict) -> set:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "fastdump")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                target = ".".join(package + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fastdump":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules or alias.name == "_C" else target)
    found.discard(name)
    return found


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def _layer(module: str) -> str:
    best = None
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (layer, prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to INTERNALS' module map)"
    return best[0]


def test_every_module_is_in_a_layer_and_in_the_module_map():
    internals = (PACKAGE.parent / "docs" / "INTERNALS.md").read_text()
    for module, (_, is_package) in _modules().items():
        _layer(module)
        if is_package or module == "fastdump._version" or module.endswith("__main__"):
            continue
        path = module.replace(".", "/")
        short = path.rsplit("/", 1)[-1]
        assert f"`{path}.py`" in internals or f"`{path}/`" in internals or f"`{short}.py`" in internals, \
            f"{module} missing from docs/INTERNALS.md's module map"


def test_no_module_imports_a_layer_above_or_beside_it():
    wrong = []
    for module, deps in _graph().items():
        mine = _layer(module)
        for dep in deps:
            theirs = _layer(dep)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    # a package's __init__ re-exporting its own modules is not a cycle with them
    edges = {m: {d for d in deps if not (m != "fastdump" and d.startswith(m + "."))} for m, deps in graph.items()}
    edges["fastdump"] = set()  # the public API imports everything lazily; nothing inside imports it back
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(edges[node]):
            dep = dep if dep in edges else dep.rsplit(".", 1)[0]
            if dep not in edges:
                continue
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_nothing_inside_the_package_imports_the_public_api_except_the_front():
    for module, deps in _graph().items():
        if "fastdump" in deps:
            assert _layer(module) == "front", f"{module} imports the top-level fastdump package"


def test_the_capture_side_knows_no_serving_framework():
    """What a framework's objects mean (SGLang's output classes, its ForwardBatch) is an integration's
    business, handed to the Dumper as watch() hooks; the capture and staging code never names them."""
    framework_words = ("LogitsProcessorOutput", "next_token_logits", "PPProxyTensors", "pp_proxy_tensors",
                       "ForwardBatch", "forward_batch")
    for folder in ("capture", "staging"):
        for path in (PACKAGE / folder).rglob("*.py"):
            text = path.read_text()
            found = [w for w in framework_words if w in text]
            assert not found, f"{path.relative_to(PACKAGE.parent)} names {found}: move it to fastdump/integrations/"
