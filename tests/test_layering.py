"""The layers import only downwards (kernels -> stages -> cluster -> deploy; tools and tests on top;
models, the embedded files, from stages up), and no module imports itself back through others, counting
the imports made inside functions. Modules are named as installed, under the raymoe namespace."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("kernels", "stages", "cluster", "protos", "deploy", "models", "tools")
# what each package may import of the project
ALLOWED = {"kernels": {"kernels"}, "stages": {"kernels", "stages", "models"}, "models": {"models"},
           "cluster": {"kernels", "stages", "models", "cluster"},
           "protos": {"protos"}, "deploy": {"kernels", "stages", "models", "cluster", "protos", "deploy"},
           "tools": set(PACKAGES)}


def modules():
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py") and not name.endswith(("_pb2.py", "_pb2_grpc.py")):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    yield module, path


def imports(module: str, path: str) -> set[str]:
    """The project modules and names `module` imports, anywhere in it (without the raymoe. prefix)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:len(module.split(".")) - node.level + is_package]
                name = "raymoe." + ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.add(name)
            found |= {f"{name}.{alias.name}" for alias in node.names}
    project = {n.removeprefix("raymoe.") for n in found if n.startswith("raymoe.")}
    plain = {n for n in found if n.split(".")[0] in PACKAGES}
    assert not plain, f"{module} imports {sorted(plain)}: the project's modules are imported as raymoe.*"
    return project


MODULES = dict(modules())


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    package = module.split(".")[0]
    above = {n for n in imports(module, MODULES[module]) if n.split(".")[0] not in ALLOWED[package]}
    assert not above, f"{module} imports {sorted(above)}"


def _module_of(name: str) -> str:
    """The project module that defines `name` (a module, or a name imported from one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def test_no_import_circles():
    graph = {m: {_module_of(n) for n in imports(m, p)} - {m, ""} for m, p in MODULES.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_parsing_engine_flags_does_not_load_ray():
    import subprocess
    import sys
    code = "import sys, raymoe.cluster.engine_args; assert 'ray' not in sys.modules, 'ray loaded'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_raymoe_imports_beside_hugging_face_kernels(tmp_path):
    """The packages live under raymoe: Hugging Face's `kernels` (which transformers >= 5.25 imports) is its own."""
    import subprocess
    import sys
    code = ("import importlib.metadata as md, kernels, transformers, raymoe.kernels.weights\n"
            "from transformers.integrations import hub_kernels\n"
            "assert md.version('kernels') and 'site-packages' in kernels.__file__, kernels.__file__\n"
            "assert raymoe.kernels.__file__.startswith(sys.argv[1]), raymoe.kernels.__file__\n"
            "assert tuple(map(int, transformers.__version__.split('.')[:2])) >= (5, 25), transformers.__version__\n")
    subprocess.run([sys.executable, "-c", "import sys\n" + code, ROOT], cwd=tmp_path, check=True)


def test_every_package_is_installed():
    """pyproject.toml lists every package folder (a new one left out would be missing from a wheel)."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    folders = {"raymoe." + m for m, path in MODULES.items() if path.endswith("__init__.py")}
    assert folders == listed, (sorted(folders - listed), sorted(listed - folders))


def test_no_test_module_imports_another():
    """Tests share code through helper modules (tests/*.py), never through another test module: test modules
    are imported by path, so one test module cannot import another by name."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if name.endswith(".py"):
                tree = ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
                for node in ast.walk(tree):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                    found += [f"{name}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not found, found
