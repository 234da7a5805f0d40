"""The package's layout: one folder per concern, dependencies one way, modules a reader can hold.

    python -m pytest tests/test_layout.py -q

The rules are docs/design.md's ("Module map"): a folder imports only the folders listed before it
(function-level imports included), core/ and perfmodel/ import neither torch nor megatron, no
module is over 400 lines, no folder holds more than a third of the package, and the README's and
docs/design.md's maps name exactly the folders and modules that exist. The test tree mirrors the
package: tests/<folder>/ tests megatron_chunkflow/<folder>/ (tests/gpu/ and tests/scripts/
aside).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "megatron_chunkflow"
TESTS = REPO / "tests"
# dependencies point down this list: a folder may import the ones before it, never after
ORDER = ["flags", "recompute", "config", "core", "perfmodel", "attention", "data", "compat",
         "runtime", "mcore", "memtrace", "training", "megatron_lm", "checks", "bench", "console", "cli"]
TOP_LEVEL = {"__init__", "__main__", "launch"}  # entry points: may import anything
OUTSIDE = {"gpu", "scripts"}  # test folders of no package folder: CUDA tests; scripts/, configs/
MODULES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def room(path: pathlib.Path) -> str:
    """The folder (or top-level module) a file of the package belongs to."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports_of(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_dependencies_point_one_way(path):
    mine = room(path)
    if mine in TOP_LEVEL:
        return
    allowed = set(ORDER[: ORDER.index(mine) + 1])
    for module in imports_of(path):
        parts = module.split(".")
        if parts[0] != "megatron_chunkflow" or len(parts) == 1:
            continue
        assert parts[1] in allowed, f"{path.relative_to(PKG)} ({mine}/) imports {module}"


@pytest.mark.parametrize("folder", ["core", "perfmodel"])
def test_models_of_the_step_are_pure(folder):
    """core/ and perfmodel/ are plain Python: no torch, megatron, flash_attn or TE."""
    for path in (PKG / folder).glob("*.py"):
        for module in imports_of(path):
            assert module.split(".")[0] not in ("torch", "megatron", "flash_attn",
                                                "transformer_engine"), (path.name, module)


def test_attention_imports_no_gpu_or_megatron_library_at_import():
    for path in (PKG / "attention").glob("*.py"):
        top = [n for n in ast.parse(path.read_text()).body
               if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names} | \
            {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m.split(".")[0] for m in names} & {"megatron", "flash_attn",
                                                       "transformer_engine"}, path.name


def test_module_and_folder_sizes():
    lines = {p: len(p.read_text().splitlines()) for p in MODULES}
    big = {str(p.relative_to(PKG)): n for p, n in lines.items() if n > 400}
    assert not big, f"modules over 400 lines: {big}"
    total = sum(lines.values())
    per_room: dict[str, int] = {}
    for p, n in lines.items():
        per_room[room(p)] = per_room.get(room(p), 0) + n
    assert max(per_room.values()) * 3 <= total, per_room


def test_readme_layout_names_every_folder():
    """The README's layout block lists each folder of the package and no folder that is gone."""
    block = re.search(r"## Layout\n.*?```\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md has no Layout section with a code block"
    listed = set(re.findall(r"^  (\w+)/", block.group(1), re.M))
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert listed == folders
    for path in re.findall(r"^([\w./-]+)\s", block.group(1), re.M):
        if path != "megatron_chunkflow/":
            assert (REPO / path.rstrip("/")).exists() or list(REPO.glob(path)), path


def test_design_module_map_names_every_module():
    """docs/design.md's module map has one line per module of the package, and only those."""
    text = (REPO / "docs" / "design.md").read_text()
    block = re.search(r"```\nmegatron_chunkflow/\n(.*?)```", text, re.S)
    assert block, "docs/design.md has no module map starting with megatron_chunkflow/"
    listed, folder = set(), ""
    for line in block.group(1).splitlines():
        m = re.match(r"^(  |    )([\w.]+/?)\s", line + " ")
        if not m:
            continue
        name = m.group(2)
        if name.endswith("/"):
            folder = name
        elif name.endswith(".py"):
            listed.add((folder if m.group(1) == "    " else "") + name)
    actual = {str(p.relative_to(PKG)) for p in MODULES if p.name != "__init__.py"}
    actual |= {"cli/__init__.py"}  # the parser lives in the package's __init__
    assert listed == actual, (sorted(actual - listed), sorted(listed - actual))


def test_tests_mirror_the_package():
    """Every tests/<folder>/ is named after a package folder (aside: tests/gpu/, the tests that need
    a CUDA GPU, and tests/scripts/, those of scripts/ and configs/), is a package (the tests import
    each other as tests.<folder>.<module>) and holds tests; every package folder with code has its
    tests/<folder>/."""
    def folders(root):
        return {p.name for p in root.iterdir()
                if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}

    package, tests = folders(PKG), folders(TESTS)
    assert tests - OUTSIDE <= package, f"test folders named after no package folder: " \
        f"{sorted(tests - OUTSIDE - package)}"
    with_code = {f for f in package if any(p.name != "__init__.py" for p in (PKG / f).glob("*.py"))}
    assert with_code <= tests, f"package folders without a test folder: {sorted(with_code - tests)}"
    for folder in tests:
        assert (TESTS / folder / "__init__.py").is_file(), f"tests/{folder}/ has no __init__.py"
        assert list((TESTS / folder).glob("test_*.py")), f"tests/{folder}/ holds no test module"


def _classes_with_fields(names: set[str]) -> set[str]:
    """Classes of the package whose annotated fields include all of `names`."""
    out = set()
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                fields = {s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if names <= fields:
                    out.add(node.name)
    return out


def test_one_layout_type():
    """ParallelConfig (config.py) is the one description of a layout: degrees of parallelism,
    sequence parallelism, recompute. Ranks (runtime/ranks.py) is this process's place in a job
    and holds no rule. No other class carries TP, PP and CP."""
    assert _classes_with_fields({"tp", "pp", "cp"}) == {"ParallelConfig", "Ranks"}
    assert not [p for p in MODULES if re.search(r"^class \w*Layout\b", p.read_text(), re.M)]


PARALLEL_STATE = ("megatron.core.parallel_state", "megatron.core.mpu")
BUILDS_GROUPS = ("initialize_model_parallel", "destroy_model_parallel",
                 "model_parallel_is_initialized", "set_virtual_pipeline_model_parallel_rank")


def _reads_parallel_state(path: pathlib.Path) -> bool:
    """Whether a file asks Megatron's parallel_state (under any name: an import alias, an
    assignment, a dotted path, getattr, a star import) for anything but building and tearing down
    the groups, takes megatron-core's groups from it (use_mpu_process_groups), or calls
    Ranks.current()."""
    text = path.read_text()
    if "Ranks.current(" in text or "use_mpu_process_groups" in text:
        return True
    tree = ast.parse(text)
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in PARALLEL_STATE:
            if any(a.name not in BUILDS_GROUPS for a in node.names):
                return True
        elif isinstance(node, ast.ImportFrom) and node.module == "megatron.core":
            aliases |= {a.asname or a.name for a in node.names
                        if a.name in ("parallel_state", "mpu")}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name in PARALLEL_STATE and a.asname}
    for node in ast.walk(tree):  # X = parallel_state
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and \
                node.value.id in aliases:
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def is_state(expr) -> bool:
        dotted = ast.unparse(expr)
        return dotted in aliases or dotted.split(".")[-1] in ("parallel_state", "mpu")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_state(node.value) and \
                node.attr not in BUILDS_GROUPS:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "getattr" and node.args and is_state(node.args[0]):
            return True
    return False


# where a Job is made from groups that something else built: init_distributed, the memory
# tracer's fake job, the Megatron-LM plugin; and the tests of the Job and of layouts' groups
JOB_MAKERS = {"megatron_chunkflow/mcore/dist.py", "megatron_chunkflow/memtrace/job.py",
              "megatron_chunkflow/megatron_lm/plugin.py", "tests/mcore/test_job.py",
              "tests/checks/test_exact.py"}


def test_process_groups_come_from_the_job():
    """Megatron's global parallel_state is read in one place, mcore/job.py (Job.from_megatron,
    called where the groups are built); the build, the step, the loss, the exchanges, the
    checks, the scripts and the tests take their degrees and groups from the Job they are
    given."""
    me = pathlib.Path(__file__).resolve()
    files = [p.resolve() for folder in (PKG, TESTS, REPO / "scripts") for p in folder.rglob("*.py")
             if "__pycache__" not in p.parts]
    files = [p for p in files if p != me]
    readers = {str(p.relative_to(REPO)) for p in files if _reads_parallel_state(p)}
    assert readers == {"megatron_chunkflow/mcore/job.py"}, sorted(readers)
    makers = {str(p.relative_to(REPO)) for p in files if "Job.from_megatron(" in p.read_text()}
    assert makers - {"megatron_chunkflow/mcore/job.py"} <= JOB_MAKERS, sorted(makers - JOB_MAKERS)


@pytest.mark.parametrize("source", [
    "from megatron.core import parallel_state as ps\nps.get_data_parallel_rank()",
    "import megatron.core.parallel_state\nmegatron.core.parallel_state.get_data_parallel_rank()",
    "from megatron.core import parallel_state\nps = parallel_state\nps.get_data_parallel_rank()",
    "from megatron.core.parallel_state import *",
    "from megatron.core.parallel_state import get_tensor_model_parallel_group",
    "from megatron.core import parallel_state\ngetattr(parallel_state, 'get_data_parallel_rank')()",
    "import megatron.core as mc\nmc.mpu.get_data_parallel_rank()",
    "from megatron.core import parallel_state\nparallel_state._DATA_PARALLEL_GROUP",
    "groups = ProcessGroupCollection.use_mpu_process_groups()",
    "ranks = Ranks.current()"])
def test_every_way_of_reading_parallel_state_is_found(tmp_path, source):
    path = tmp_path / "reader.py"
    path.write_text(source + "\n")
    assert _reads_parallel_state(path)
    path.write_text("from megatron.core import parallel_state\n"
                    "parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)\n"
                    "parallel_state.destroy_model_parallel()\n")
    assert not _reads_parallel_state(path)


def test_cli_modules_import_no_other_cli_module():
    """Each subcommand is argparse and printing; what two of them share lives in a room below."""
    for path in (PKG / "cli").glob("*.py"):
        others = [m for m in imports_of(path) if m.startswith("megatron_chunkflow.cli")]
        assert not others, f"cli/{path.name} imports {others}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_only_cli_imports_checks_and_bench(path):
    """checks/ and bench/ are what `chunkflow verify` and `bench` run; no other room (bench
    included for checks/, and the reverse) builds on them."""
    mine = room(path)
    if mine in ("cli", *TOP_LEVEL):
        return
    for module in imports_of(path):
        parts = module.split(".")
        if parts[0] == "megatron_chunkflow" and len(parts) > 1 and parts[1] in ("checks", "bench"):
            assert parts[1] == mine, f"{path.relative_to(PKG)} ({mine}/) imports {module}"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


KNOWN = {_module_name(p) for p in MODULES}


def _import_edges(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported inside a function) by `path`, both
    of this package; imports under `if TYPE_CHECKING:` are neither (nothing runs them)."""
    tree = ast.parse(path.read_text())
    top, local = set(), set()

    def names(node) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names}
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from pkg import module` names that module; `from module import name` the module
            subs = {f"{node.module}.{a.name}" for a in node.names} & KNOWN
            return subs if len(subs) == len(node.names) else subs | {node.module}
        return set()

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            found = names(child)
            (local if in_function else top).update(
                m for m in found if m.startswith("megatron_chunkflow."))
            visit(child, in_function or isinstance(child, (ast.FunctionDef,
                                                            ast.AsyncFunctionDef)))
    visit(tree, False)
    mine = _module_name(path)  # a submodule importing its own package: no circle to speak of
    return ({m for m in top if not mine.startswith(m + ".")},
            {m for m in local if not mine.startswith(m + ".")})


def test_no_function_local_import_closes_a_circle():
    """A module imported inside a function may not import (at module level, transitively) the
    module that imports it: a circle hidden by a late import. The helper both need moves down."""
    known = KNOWN
    edges = {_module_name(p): _import_edges(p) for p in MODULES}
    top = {m: {t for t in e[0] if t in known} for m, e in edges.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(top.get(m, ()))
        return False

    circles = sorted(f"{m} -> {t} (inside a function) -> ... -> {m}"
                     for m, (_, local) in edges.items() for t in local
                     if t in known and t != m and reaches(t, m))
    assert not circles, "\n".join(circles)
