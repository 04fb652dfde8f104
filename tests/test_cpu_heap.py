"""[Note: a kept CPU heap] (python/braze/cpu_heap.py): a CPU training step's saved activations
are freed in the backward and allocated again in the next forward; with the heap kept, memory
freed stays with the process and comes back without page faults. Each case runs in a fresh
process: the setting is process-wide, and this test process has compiled training graphs."""
import platform
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import copy, os, sys, torch, braze
    keep = sys.argv[1] == "1"
    def faults():
        return int(open(f"/proc/{os.getpid()}/stat").read().split()[9])
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    ref = copy.deepcopy(m)
    c = torch.compile(m, backend="braze", options={"on_unsupported": "error", "keep_cpu_heap": keep})
    with torch.no_grad():
        x = torch.randn(32, 64)
        torch.testing.assert_close(c(x), ref(x))
    before = braze.cpu_heap.kept()  # an inference graph keeps nothing
    for _ in range(3):  # training steps on fresh inputs, against eager
        x = torch.randn(32, 64)
        c(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for a, b in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert braze.stats.graphs_eager == 0
    # What steps do to their activations: eight of 8 MiB allocated and written, then all
    # freed; the faults of the last of four such steps.
    for i in range(4):
        if i == 3:
            f0 = faults()
        acts = [torch.empty(2 << 20).fill_(float(k)) for k in range(8)]
        del acts
    print("result", before, braze.cpu_heap.kept(), faults() - f0)
""")


def _probe(keep):
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if keep else "0"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    _, before, kept, faults = [ln for ln in out.stdout.splitlines() if ln.startswith("result")][-1].split()
    return before == "True", kept == "True", int(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_kept_heap_serves_freed_memory_without_page_faults():
    """A training graph (compared with eager on fresh inputs) keeps the heap; an inference
    graph does not. Then steps that allocate and write eight 8 MiB activations and free them
    all: from the kept heap, a later step's pages are already the process's (a few faults at
    most); with `keep_cpu_heap=False`, glibc's default returns the freed top of its heap, and
    each step faults in its 16,384 pages again."""
    before, kept, kept_faults = _probe(True)
    _, trimmed_kept, trimmed_faults = _probe(False)
    assert not before and kept and not trimmed_kept
    assert trimmed_faults > 8000, trimmed_faults
    assert kept_faults < 200, kept_faults
