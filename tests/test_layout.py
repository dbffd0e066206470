"""The layout's rules (docs/development.md): the package's folders are layers, no import closes
a circle (imports inside functions counted), and the benchmarks use eaglet's public names only."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "eaglet"

# Each module's layer, by its first part under eaglet/: a module imports from its own part and
# the layers below only.
FLOORS = {"errors": -1, "config": 0, "distributed": 0, "utils": 0, "context": 0, "draft": 1, "formats": 2,
          "targets": 3, "checks": 4, "engines": 5, "testing": 6, "training": 6, "doctor": 7, "evaluation": 7,
          "regeneration": 7, "stages": 8, "pipeline": 9, "shadow": 10, "demo": 10, "cli": 11}


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every eaglet module `path` imports, wherever the import stands."""
    me = _module(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "eaglet"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "eaglet":
                continue
            for a in node.names:  # `from .pkg import module` names a module; `from .mod import name` a name
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if (REPO / sub.replace(".", "/")).with_suffix(".py").is_file()
                              or (REPO / sub.replace(".", "/")).is_dir() else base))
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {t for _, t in _imports(p) if t in files and t != m} for m, p in files.items()}


def test_no_import_circle_counting_imports_inside_functions():
    graph, state, circles = _graph(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(path[path.index(t):] + [t] if t in path else [m, t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def test_each_module_imports_from_its_own_folder_and_the_layers_below():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        me = _module(path).split(".")
        if len(me) < 2:
            continue  # eaglet/__init__.py
        for line, target in _imports(path):
            them = target.split(".")
            if len(them) < 2:
                continue
            if them[1] == me[1]:
                continue  # within one folder (or module)
            if FLOORS[them[1]] >= FLOORS[me[1]]:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target} (layer {them[1]} is not below {me[1]})")
    assert not bad, "\n".join(bad)
    assert set(FLOORS) == {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
                           if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").is_file())}


def test_benchmarks_use_public_names_and_no_path_edits():
    bad = []
    for path in sorted((REPO / "bench").glob("*.py")):
        text = path.read_text()
        if "sys.path" in text:
            bad.append(f"{path.name}: edits sys.path")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eaglet"):
                bad += [f"{path.name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_")]
                bad += [f"{path.name}:{node.lineno} imports {node.module}" for _ in [0]
                        if any(part.startswith("_") for part in node.module.split("."))]
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and node.col_offset >= 0:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                local = {p.stem for p in (REPO / "bench").glob("*.py")}
                bad += [f"{path.name}:{node.lineno} imports the benchmark {n}" for n in names if n.split(".")[0] in local]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and node.value.id.endswith("_mod"):
                bad.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_tests_do_not_import_benchmarks():
    local = {p.stem for p in (REPO / "bench").glob("*.py")}
    bad = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path == Path(__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in local or n.split(".")[0] == "bench"]
        text = path.read_text()
        if "spec_from_file_location" in text and "bench" in text:
            bad.append(f"{path.name}: loads a benchmark module")
        # scripts the tests write and run (strings, not parsed above) must not reach into bench/ either
        bad += [f"{path.name}:{n}: {ln.strip()}" for n, ln in enumerate(text.splitlines(), 1)
                if "sys.path" in ln and "bench" in ln]
    assert not bad, "\n".join(bad)


def test_eaglet_modules_are_imported_at_the_top():
    """An import inside a function is kept only for a heavy or optional dependency: eaglet's own
    modules are imported at the top of a module (the one exception: the remote-code stand-in,
    which imports transformers' model classes, imported only when it is asked for)."""
    allowed = {("eaglet/testing/tiny.py", "remote_kimi_k25")}
    bad = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(REPO))
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("eaglet")):
                    names = [a.name for a in node.names]
                    if not any((rel, n) in allowed for n in names):
                        bad.append(f"{rel}:{node.lineno} imports {names} inside {fn.name}")
    assert not bad, "\n".join(bad)


def test_the_machinery_of_eval_and_regenerate_sits_in_small_modules():
    """What stages/evaluate.py and stages/regenerate.py call (eaglet/evaluation/,
    eaglet/regeneration/, eaglet/engines/hf/generate.py) sits in modules of ~300 lines at most."""
    limits = {"eaglet/engines/hf/generate.py": 300}
    for folder in ("evaluation", "regeneration"):
        modules = sorted((PACKAGE / folder).glob("*.py"))
        assert len(modules) > 1, folder
        limits.update({str(p.relative_to(REPO)): 300 for p in modules})
    over = [f"{path}: {n} lines, over {limit}" for path, limit in limits.items()
            if (n := len((REPO / path).read_text().splitlines())) > limit]
    assert not over, "\n".join(over)


# ---- stages/ holds stage entry points only; training/ is small modules ---------------------------

STAGE_MODULE_LINES = 180  # a stage entry point: read its inputs, call the machinery, write its outputs
TRAINING_MODULE_LINES = 300


def _entry_points() -> dict[str, str]:
    """{stage module: its run_* function} as the pipeline's STAGES table ("eaglet.stages.M:run_F")
    and the CLI (commands outside the pipeline) name them."""
    found = {}
    for node in ast.walk(ast.parse((PACKAGE / "pipeline.py").read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("eaglet.stages."):
            module, _, fn = node.value.partition(":")
            found[module.rsplit(".", 1)[1]] = fn
    for node in ast.walk(ast.parse((PACKAGE / "cli.py").read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stages."):
            found.update({node.module.split(".")[1]: a.name for a in node.names if a.name.startswith("run_")})
    return found


def _lines(path: Path) -> int:
    """Lines as `wc -l` counts them."""
    return path.read_text().count("\n")


def test_each_stage_module_is_a_stage_entry_point():
    """Every module in eaglet/stages/ defines the run_* function that the pipeline's STAGES (or a
    CLI command) names, and is at most STAGE_MODULE_LINES long: its machinery lives in its layer
    (training/, engines/, evaluation/, formats/, ...)."""
    entries, bad = _entry_points(), []
    for path in sorted((PACKAGE / "stages").glob("*.py")):
        if path.stem == "__init__":
            continue
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        if entries.get(path.stem) not in defined:
            bad.append(f"stages/{path.stem}.py: no run_* function that the pipeline or the CLI names")
        if _lines(path) > STAGE_MODULE_LINES:
            bad.append(f"stages/{path.stem}.py: {_lines(path)} lines, over {STAGE_MODULE_LINES}")
    assert not bad, "\n".join(bad)


def test_no_training_module_is_over_300_lines():
    bad = [f"training/{p.name}: {_lines(p)} lines" for p in sorted((PACKAGE / "training").glob("*.py"))
           if _lines(p) > TRAINING_MODULE_LINES]
    assert not bad, "\n".join(bad)
