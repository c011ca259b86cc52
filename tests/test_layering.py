"""The layers import only downwards (kernels -> stages -> cluster -> deploy; tools and tests on top;
models, the embedded files, from stages up),
and no module imports itself back through others at import time."""
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


def imports(module: str, path: str, top_level_only: bool) -> set[str]:
    """The project modules `module` imports (at import time only, when top_level_only)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    is_package = path.endswith("__init__.py")
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:len(module.split(".")) - node.level + is_package]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.add(name)
            found |= {f"{name}.{alias.name}" for alias in node.names}
    return {n for n in found if n.split(".")[0] in PACKAGES}


MODULES = dict(modules())


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    package = module.split(".")[0]
    above = {n for n in imports(module, MODULES[module], top_level_only=False) if n.split(".")[0] not in ALLOWED[package]}
    assert not above, f"{module} imports {sorted(above)}"


def test_no_import_circles():
    graph = {m: {n for n in imports(m, p, top_level_only=True) if n in MODULES and n != m} for m, p in MODULES.items()}
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
    code = "import sys, cluster.engine_args; assert 'ray' not in sys.modules, 'ray loaded'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
