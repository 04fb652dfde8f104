import os

import pytest
import torch

# Compiled kernels are cached per test session in a private directory unless the caller
# chose one, so a run never depends on what an earlier run left behind.
if "BRAZE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["BRAZE_CACHE_DIR"] = tempfile.mkdtemp(prefix="braze-test-cache-")

torch._dynamo.config.cache_size_limit = 64
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 64


def pytest_addoption(parser):
    parser.addoption("--device", default=os.environ.get("BRAZE_TEST_DEVICE", "cpu"), help="cpu or cuda")


@pytest.fixture
def device(request):
    d = request.config.getoption("--device")
    if d == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return d


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
