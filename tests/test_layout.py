"""The house (README, "Layout of the code"): a folder per concern, imports that run one way.

Every import of every jaxpar module is read from its source (those inside functions too: a lazy
import is still a dependency), and the graph is checked: no circle between modules, and no import
from a lower floor to a higher one, the floors being the folders in the order below. A new module
lands on its folder's floor; a new folder must be placed here, which is the point."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxpar"
# Lowest first. A module may import from its own floor or any floor below it.
FLOORS = [
    ["jaxpar", "jaxpar.errors", "jaxpar.files", "jaxpar.cli"],
    ["jaxpar.config"],  # plain data: no model, JAX or Hugging Face code
    ["jaxpar.sharding"],
    ["jaxpar.layers"],
    ["jaxpar.models"],
    ["jaxpar.data", "jaxpar.interop"],
    ["jaxpar.parallel"],
    ["jaxpar.compiler"],
    ["jaxpar.planner", "jaxpar.inference"],
    ["jaxpar.robot"],
    ["jaxpar.training"],
    ["jaxpar.train", "jaxpar.plan", "jaxpar.generate", "jaxpar.rollout", "jaxpar.export"],  # entry points
]
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def module_name(path: pathlib.Path) -> str:
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The jaxpar modules `name` imports (`from a.b import c` counts a.b.c when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def floor_of(name: str) -> int:
    """The floor of the module's folder (or of the module itself, at the package root)."""
    parts = name.split(".")
    for depth in (2, 1):
        if ".".join(parts[:depth]) in FLOOR:
            return FLOOR[".".join(parts[:depth])]
    raise AssertionError(f"{name} is on no floor: add its folder to tests/test_layout.py's FLOORS")


def test_no_import_runs_up_a_floor():
    upward = [f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if floor_of(b) > floor_of(a)]
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(sorted(upward))


def test_no_import_circle():
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            raise AssertionError("import circle: " + " -> ".join(on_path[on_path.index(name):] + [name]))
        if name in done:
            return
        on_path.append(name)
        for target in sorted(GRAPH[name]):
            visit(target)
        on_path.pop()
        done.add(name)

    for name in sorted(GRAPH):
        visit(name)


def test_the_root_keeps_at_most_ten_modules():
    root = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert len(root) <= 10, root
    assert set(packages) == {"compiler", "config", "data", "inference", "interop", "layers", "models", "parallel",
                             "planner", "robot", "training"}


@pytest.mark.parametrize("package, forbidden", [
    ("jaxpar.config", ("jaxpar.models", "jaxpar.interop", "jaxpar.parallel")),  # validation reads no model code
    ("jaxpar.layers", ("jaxpar.parallel",)),  # the hooks are handed in (Collectives.zero_hooks)
])
def test_low_folders_do_not_reach_up(package, forbidden):
    reached = {f"{a} -> {b}" for a, targets in GRAPH.items() if a.startswith(package)
               for b in targets if b.startswith(forbidden)}
    assert not reached, reached


def test_the_entry_points_check_flags_and_config_before_jax_starts():
    """A user's mistake costs no JAX start-up, and --gpu prepares its environment before JAX looks for
    plugins: importing the train entry point, the config and the run assembly imports no JAX."""
    import subprocess
    import sys

    code = ("import sys, jaxpar.train, jaxpar.plan, jaxpar.config, jaxpar.interop.pretrained; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
