import sys
from pathlib import Path

import pytest

# Test helper modules (e.g. tests/recipes/toy.py) import by their bare name.
sys.path.insert(0, str(Path(__file__).parent / "recipes"))


@pytest.fixture(scope="session")
def tiny_shapes_dir(tmp_path_factory) -> Path:
    """A tiny, randomly initialised shapes model saved with the real saving code (32x32, ~60k params)."""
    from flowrl.models.shapes import ShapesModel, ShapesModelConfig

    path = tmp_path_factory.mktemp("tiny_shapes")
    config = ShapesModelConfig(block_out_channels=[8, 16], head_dim=8, text_hidden_size=16, text_layers=1,
                               text_heads=2)
    ShapesModel.build(config, seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests, restored after them: the tiny models' ops are far too small to gain
    from intra-op threads, and on a shared 2-core machine spinning worker threads make them 10-20x slower. A module
    takes it with ``pytestmark = pytest.mark.usefixtures("one_thread")``, a folder with an autouse fixture in its
    conftest.py that requests it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _denormals_kept_after_each_test():
    """A run flushes float32 denormals for its process (``run.flush_denormal``, flowrl.run.runtime.prepare_run); put
    torch's default back after each test, so no test's numbers depend on which tests ran before it."""
    yield
    import torch

    torch.set_flush_denormal(False)


def pytest_configure(config):
    """``FLOWRL_TEST_DISABLE_ONEDNN=1`` runs the suite with torch's oneDNN (mkldnn) kernels off: a stand-in for a
    CPU that takes other kernels, used to check that numeric tests hold across machines."""
    import os

    if os.environ.get("FLOWRL_TEST_DISABLE_ONEDNN") == "1":
        import torch

        torch.backends.mkldnn.enabled = False
