"""The model's rooms are in layers: each imports only the rooms below it (none imports one above, so there are no
circles), and the launch's checks of a checkpoint load no JAX.

Below every room: model/errors.py and model/contract.py. Then storage, config (with model/options.py, the load
settings), parallel, nets, loading, engine, preflight. model/__init__.py, the front door, may import any of them.
"""

import ast
import os
import subprocess
import sys

from paths import REPO

LAYERS = ("base", "storage", "config", "parallel", "nets", "loading", "engine", "preflight")
TOP_MODULES = {"errors": "base", "contract": "base", "options": "config"}  # model/*.py outside the rooms


def room_of(module: str) -> str | None:
    """The layer of a module of the package (dotted, without the leading 'model.'); None for the front door."""
    first = module.split(".")[0]
    if first in ("", "__init__"):
        return None
    return TOP_MODULES.get(first, first)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module inside `model`, dotted without 'model.') of each import of the package in `source` (the file
    of `module`), at any depth: relative imports resolved, `from . import x` read as the module x."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module.split(".")[0] == "model":
                base = node.module.split(".")[1:]
            else:
                continue
            names = [a.name for a in node.names]
            if not base:  # from model import x / from .. import x: x is a module or a name of the front door
                found += [(node.lineno, n) for n in names]
            elif len(base) == 1 and base[0] not in TOP_MODULES:  # from ..nets import attention: a module of a room
                found += [(node.lineno, f"{base[0]}.{n}") for n in names]
            else:
                found.append((node.lineno, ".".join(base)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, ".".join(a.name.split(".")[1:])) for a in node.names
                      if a.name.split(".")[0] == "model"]
    return found


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """`line: room -> room` for each import of a room above the file's own (or of the front door)."""
    own = room_of(module)
    out = []
    for line, target in imported_modules(source, module, is_package):
        room = room_of(target)
        if room is None or room not in LAYERS:
            out.append(f"{line}: {own} -> model{'.' + target if target else ''}")
        elif LAYERS.index(room) > LAYERS.index(own):
            out.append(f"{line}: {own} -> {room} ({target})")
    return out


def test_upward_imports_are_found():
    """The check itself: an import of a higher room, relative or absolute, at any depth, and one through the front
    door are reported; imports of the own room and of lower ones are not."""
    source = ("from ..config.configs import PipelineConfig\nfrom ..errors import CheckpointError\n"
              "from .safetensors_file import open_component\nfrom ..engine.factory import Networks\n"
              "def f():\n    from model.preflight import aot\n    import model\n    from ..nets import quantize\n")
    assert upward_imports(source, "loading.checkpoint") == ["4: loading -> engine (engine.factory)",
                                                            "6: loading -> preflight (preflight.aot)",
                                                            "7: loading -> model"]
    assert upward_imports("from . import gcs\nfrom ..errors import CheckpointError\n", "storage.leases") == []
    assert upward_imports("from .loading.weight_files import x\n", "options") == ["1: config -> loading "
                                                                                  "(loading.weight_files)"]


def test_each_room_imports_only_the_rooms_below_it():
    found = {}
    root = os.path.join(REPO, "model")
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            is_package = rel.endswith("__init__")
            module = rel[:-len(".__init__")] if is_package else rel
            if rel == "__init__":
                continue  # the front door
            assert room_of(module) in LAYERS, f"{rel}: a room the layers do not place; add it to LAYERS"
            with open(path, encoding="utf-8") as f:
                bad = upward_imports(f.read(), module, is_package)
            if bad:
                found[os.path.relpath(path, REPO)] = bad
    assert found == {}, found


def test_the_launch_checks_load_no_jax(tiny_ckpt, tmp_path):
    """The launch's checks of the job (pipeline.launch.resolve_job: the options, the checkpoint's configs and every
    weight file's header, the inputs and the output) and the model's own check of a checkpoint import neither JAX nor
    Flax: a launch stays fast, and a machine without an accelerator runtime can launch."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    code = ("import sys\n"
            "from apache_beam.options.pipeline_options import PipelineOptions\n"
            "import model\n"
            "from pipeline.launch import resolve_job\n"
            f"model.read_config_and_digest({tiny_ckpt!r}, check_weights=True)\n"
            f"resolve_job(PipelineOptions(['--model={tiny_ckpt}', '--input={prompts}', "
            f"'--output={tmp_path / 'out'}']))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))[:5])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout[-2000:] + out.stderr[-2000:]


def third_party_roots(source: str) -> set[str]:
    """The top-level packages `source` imports, at any depth (relative imports left out)."""
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
    return roots


def test_the_storage_room_imports_neither_beam_nor_jax():
    """model/storage/ is what the model, the job and its Beam building blocks all reach storage through: it may use
    google-cloud-storage, never Beam (the model must not need it) nor JAX (a launch must not load it)."""
    assert third_party_roots("def f():\n    from apache_beam.io import gcsio\nimport jax.numpy\n") == {
        "apache_beam", "jax"}
    folder = os.path.join(REPO, "model", "storage")
    found = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".py")):
        with open(os.path.join(folder, file), encoding="utf-8") as f:
            bad = third_party_roots(f.read()) & {"apache_beam", "jax", "jaxlib", "flax"}
        if bad:
            found[file] = sorted(bad)
    assert found == {}, found
