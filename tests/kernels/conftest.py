"""Kernel tests compile into one per-session cache directory, never the user's cache; the
variable is set only while this folder's tests run."""

import pytest


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="module", autouse=True)
def _use_kernel_cache_dir(kernel_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("REINFORGE_KERNEL_CACHE", str(kernel_cache_dir))
    yield
    mp.undo()
