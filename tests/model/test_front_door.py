"""`model/__init__.py` is the model's one public surface: pipeline/ and transforms/ import `model` and the names it
lists, never a module inside it; every listed name exists, and importing `model` (and the job's launcher) loads no
JAX."""

import ast
import os
import subprocess
import sys

from paths import REPO

FRONT_DOOR_USERS = ("pipeline", "transforms")


def model_imports(source: str) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of the `model` package or a module inside it, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "model":
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "model"]
    return found


def back_doors(source: str, public: set[str]) -> list[str]:
    """`line: what` for each import that goes round the front door: a module inside `model`, or a name from `model`
    that it does not list (a module of the package among them)."""
    out = []
    for line, module, names in model_imports(source):
        if module != "model":
            out.append(f"{line}: {module}")
        out += [f"{line}: model.{name}" for name in names if name not in public]
    return out


def test_back_doors_are_found():
    """The check itself: a module inside `model`, imported either way, and an unlisted name are each reported;
    `import model` and listed names are not."""
    source = ("import model\nfrom model import load, RequestError\nfrom model.contract import show\n"
              "def f():\n    from model import contract\n    import model.engine.runtime as r\n")
    assert back_doors(source, {"load", "RequestError", "show"}) == ["3: model.contract", "5: model.contract",
                                                                    "6: model.engine.runtime"]


def test_pipeline_and_transforms_use_the_front_door_only():
    """Every file of pipeline/ and transforms/ (sub-packages included) imports `model` and its listed names only."""
    import model

    public = set(model.__all__)
    found = {}
    for package in FRONT_DOOR_USERS:
        for folder, dirs, files in os.walk(os.path.join(REPO, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for file in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, file)
                with open(path, encoding="utf-8") as f:
                    bad = back_doors(f.read(), public)
                if bad:
                    found[os.path.relpath(path, REPO)] = bad
    assert found == {}, found


def test_every_public_name_exists_and_the_light_ones_load_no_jax():
    """Each name in `model.__all__` resolves; resolving all but model.JAX_NAMES, and importing the job's launcher and
    its transforms, loads no JAX (a launch and a pickled handler stay light)."""
    code = ("import sys, model, pipeline.run, pipeline.preflight, transforms.inference, transforms.references\n"
            "light = [n for n in model.__all__ if n not in model.JAX_NAMES]\n"
            "missing = [n for n in light if getattr(model, n, None) is None]\n"
            "assert not missing, missing\n"
            "assert 'jax' not in sys.modules, 'jax loaded'\n"
            "assert all(callable(getattr(model, n)) for n in model.JAX_NAMES)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_no_module_of_the_package_hides_behind_a_public_name():
    """A listed name is never one of the package's rooms or modules: `from model import x` always means a name."""
    import model

    inside = {name for name in os.listdir(os.path.join(REPO, "model"))
              if name.endswith(".py") or os.path.isdir(os.path.join(REPO, "model", name))}
    inside = {name.removesuffix(".py") for name in inside}
    assert set(model.__all__) & inside == set()
