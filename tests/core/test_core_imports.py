"""Every module of the package imports: the first thing a new release of a dependency breaks."""

import importlib
import pkgutil

import pytest

pytestmark = pytest.mark.smoke

LAYERS = ("core", "actors", "kernels", "envs", "engine")  # folders mapped into the package


def all_module_names() -> list[str]:
    """Every module under `reinforge`, but `__main__` (importing it runs the CLI)."""
    names = ["reinforge", "reinforge.cli"]
    for layer in LAYERS:
        package = importlib.import_module(f"reinforge.{layer}")
        names.append(package.__name__)
        names += [info.name for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]
    return names


def test_the_module_list_covers_every_layer_with_its_modules():
    names = all_module_names()
    for layer in LAYERS:
        assert len([n for n in names if n.startswith(f"reinforge.{layer}.")]) >= 3, layer


@pytest.mark.parametrize("name", all_module_names())
def test_every_module_imports(name):
    importlib.import_module(name)
