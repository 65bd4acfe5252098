"""The layering invariants of ARCHITECTURE.md, checked on the source."""

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent
LOWER_LAYERS = {"actors", "envs", "kernels", "engine"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_core_imports_nothing_from_the_layers_above_it():
    offenders = []
    for path in sorted((ROOT / "core").glob("*.py")):
        for mod in imported_modules(path):
            parts = mod.split(".")
            if parts[0] == "reinforge" and len(parts) > 1 and parts[1] in LOWER_LAYERS:
                offenders.append(f"{path.name} imports {mod}")
    assert offenders == []


def test_kernels_and_engine_do_not_import_actors():
    offenders = []
    for folder in ("kernels", "engine", "envs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for mod in imported_modules(path):
                if mod.startswith("reinforge.actors"):
                    offenders.append(f"{folder}/{path.name} imports {mod}")
    assert offenders == []


def test_no_actor_module_imports_another_actor_module_only_messages_and_subjects():
    actor_modules = {"sampler", "verifier", "learner", "scheduler", "evaluator", "monitor"}
    offenders = []
    for path in sorted((ROOT / "actors").glob("*.py")):
        if path.stem not in actor_modules:
            continue
        for mod in imported_modules(path):
            parts = mod.split(".")
            if mod.startswith("reinforge.actors.") and parts[2] in actor_modules - {path.stem}:
                offenders.append(f"actors/{path.name} imports {mod}")
    assert offenders == []


def test_the_rl_algorithm_imports_no_messaging_and_no_actor():
    """reinforge.rl is the algorithm on plain data: no trio, no NATS, no actor, no bus."""
    forbidden = ("trio", "nats", "trio_asyncio", "reinforge.actors", "reinforge.core.bus",
                 "reinforge.core.actor")
    offenders = []
    for path in sorted((ROOT / "reinforge" / "rl").glob("*.py")):
        for mod in imported_modules(path):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                offenders.append(f"rl/{path.name} imports {mod}")
    assert sorted(p.stem for p in (ROOT / "reinforge" / "rl").glob("*.py")) != []
    assert offenders == []


def test_the_rollout_package_imports_no_actor():
    """The supervisor (core) starts the rollout server through reinforge.rollout."""
    offenders = [f"rollout/{path.name} imports {mod}"
                 for path in sorted((ROOT / "reinforge" / "rollout").glob("*.py"))
                 for mod in imported_modules(path) if mod.startswith("reinforge.actors")]
    assert offenders == []


def test_every_command_lives_in_reinforge_cli_one_module_each():
    from reinforge.cli import COMMAND_MODULES

    modules = {p.stem for p in (ROOT / "reinforge" / "cli").glob("*.py")} - {"__init__"}
    assert {m.rsplit(".", 1)[1] for m in COMMAND_MODULES} == modules
    folders = ("core", "actors", "envs", "kernels", "engine", "reinforge/rl", "reinforge/rollout")
    sources = [p for folder in folders for p in (ROOT / folder).rglob("*.py")]
    elsewhere = [str(p.relative_to(ROOT)) for p in sources
                 if "def register(subparsers" in p.read_text()]
    assert elsewhere == []


def test_the_actors_folder_holds_actors_only():
    """Each module of actors/ defines an actor (a class with an `actor_type`); the algorithm,
    the rollout plumbing, the metrics and the commands live in their own packages."""
    without = [p.name for p in sorted((ROOT / "actors").glob("*.py"))
               if p.name != "__init__.py" and "actor_type = " not in p.read_text()]
    assert without == []
