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
    import copy, ctypes, mmap, os, sys, torch, braze
    keep = sys.argv[1] == "1"
    def faults():
        return int(open(f"/proc/{os.getpid()}/stat").read().split()[9])
    class Mallinfo2(ctypes.Structure):  # glibc's malloc.h: ten size_t fields
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    def free_in_heap():  # bytes free in glibc's heap: the process's, not the system's
        if not hasattr(libc, "mallinfo2"):  # glibc before 2.33
            return -1
        libc.mallinfo2.restype = Mallinfo2
        return libc.mallinfo2().fordblks
    # Whether this kernel counts minor faults (some sandboxes report 0): touch 64 fresh pages.
    f0, region = faults(), mmap.mmap(-1, 64 * 4096)
    for p in range(64):
        region[p * 4096] = 1
    counts_faults = faults() - f0 >= 32
    region.close()
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
    # What steps do to their activations: sixteen of 8 MiB allocated and written, then all
    # freed (128 MiB: above the 64 MiB that glibc's dynamic trim threshold can reach, so
    # glibc's default returns them whatever this process freed before); the faults of the
    # last of four such steps, and what the heap holds free after it. They come from malloc
    # itself, as PyTorch's CPU allocator takes them: torch.empty's small bookkeeping, freed
    # into glibc's per-thread cache, can sit above the last activation and keep the top of
    # the heap from being returned at all, which made the unkept case vary from run to run.
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.restype, libc.free.argtypes = None, (ctypes.c_void_p,)
    for i in range(4):
        if i == 3:
            f0 = faults()
        acts = [libc.malloc(8 << 20) for k in range(16)]
        for k, a in enumerate(acts):
            ctypes.memset(a, k + 1, 8 << 20)
        for a in acts:
            libc.free(a)
    print("result", before, braze.cpu_heap.kept(), faults() - f0 if counts_faults else -1, free_in_heap())
""")


def _probe(keep):
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if keep else "0"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    _, before, kept, faults, free = [ln for ln in out.stdout.splitlines() if ln.startswith("result")][-1].split()
    return before == "True", kept == "True", int(faults), int(free)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_kept_heap_serves_freed_memory_without_page_faults():
    """A training graph (compared with eager on fresh inputs) keeps the heap; an inference
    graph does not. Then steps that allocate and write sixteen 8 MiB activations and free them
    all: from the kept heap, a later step's pages are already the process's (a few faults at
    most); with `keep_cpu_heap=False`, glibc's default returns the freed top of its heap, and
    each step faults in its 32,768 pages again. glibc's own count of free heap bytes
    (`mallinfo2`) says where the 128 MiB went; the fault counts are checked where the kernel
    counts faults (some sandboxes report none)."""
    before, kept, kept_faults, kept_free = _probe(True)
    _, trimmed_kept, trimmed_faults, trimmed_free = _probe(False)
    assert not before and kept and not trimmed_kept
    if kept_free >= 0 and trimmed_free >= 0:
        assert kept_free >= 128 << 20, kept_free
        assert trimmed_free < 64 << 20, trimmed_free
    assert max(kept_free, kept_faults) >= 0, "neither glibc nor the kernel can say where the memory went"
    if kept_faults >= 0 and trimmed_faults >= 0:
        assert trimmed_faults > 16000, trimmed_faults
        assert kept_faults < 200, kept_faults
