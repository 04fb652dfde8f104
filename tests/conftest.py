import os

import pytest
import torch

# Compiled kernels are cached per test session in a private directory unless the caller
# chose one, so a run never depends on what an earlier run left behind.
if "BRAZE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["BRAZE_CACHE_DIR"] = tempfile.mkdtemp(prefix="braze-test-cache-")

# Every graph compiled for the CPU is also compiled for the GPU with NVRTC (which needs no
# GPU), so a CUDA codegen error fails the suite on any machine.
os.environ.setdefault("BRAZE_CHECK_CUDA", "1")

# A graph braze would run eagerly fails its test: tests that exercise a deliberate fallback
# say so with options={"on_unsupported": "warn"}.
os.environ.setdefault("BRAZE_ON_UNSUPPORTED", "error")

torch._dynamo.config.cache_size_limit = 64
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 64


@pytest.fixture
def device():
    """The device under test: BRAZE_TEST_DEVICE (cpu, the default, or cuda)."""
    d = os.environ.get("BRAZE_TEST_DEVICE", "cpu")
    if d == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return d


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with Dynamo's caches empty and braze's counters at zero (so a test
    reads its own counts), and fails if a lowering raised anything but Unsupported."""
    import braze

    torch._dynamo.reset()
    braze.stats.reset()
    yield
    errs = braze.stats.lowering_errors
    assert not errs, f"braze lowering error in {errs[0][0]} ({errs[0][1]}):\n{errs[0][2]}"


@pytest.fixture
def compiled_graphs(monkeypatch):
    """The CompiledGraph objects braze makes during the test, in order."""
    from braze import runtime

    made = []
    init = runtime.CompiledGraph.__init__

    def keep(self, *a):
        init(self, *a)
        made.append(self)
    monkeypatch.setattr(runtime.CompiledGraph, "__init__", keep)
    return made


@pytest.fixture
def relayouts(monkeypatch):
    """The runtime's layout copies during the test (an input or extern result copied into the
    layout its graph was compiled for), as (graph name, shape), in order."""
    from braze import runtime

    seen = []
    relayout = runtime.CompiledGraph._relayout

    def counted(self, t, *a):
        seen.append((self.name, tuple(t.shape)))
        return relayout(self, t, *a)
    monkeypatch.setattr(runtime.CompiledGraph, "_relayout", counted)
    return seen
