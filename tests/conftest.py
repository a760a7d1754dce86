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


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir(kind)``: the directory of the tiny pipeline ``kind`` (``"sd3"``, ``"flux"`` or a key of
    ``flowrl.testing.TINY_FAMILIES``: ``"z_image"``, ``"flux2_klein"``, ``"flux2"`` (FLUX.2 [dev]), ``"qwen_image"``,
    ``"qwen_image_edit"``, ``"flux_kontext"``, ``"wan"``, ``"wan22"``), built with ``flowrl.testing.build_tiny`` and
    written with ``save_pretrained`` on its first request and reused for the rest of the session, so tests load it
    through the real ``from_pretrained`` code. Built on one torch thread (see ``one_thread``). Built from the current
    builder code into the session's temp folder, never the per-user cache, so an edited tiny builder is what runs;
    the global torch random state is left as it was. A test must not write into the directory: copy it first."""
    built: dict[str, Path] = {}
    root = None

    def _tiny_dir(kind: str) -> Path:
        nonlocal root
        if kind not in built:
            import torch

            from flowrl.testing import build_tiny

            root = root or tmp_path_factory.mktemp("tiny_pipelines")
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with torch.random.fork_rng(devices=[]):  # a lazy build inside a test leaves its random draws alone
                    built[kind] = build_tiny(kind, root / kind)
            finally:
                torch.set_num_threads(threads)
        return built[kind]

    return _tiny_dir


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
