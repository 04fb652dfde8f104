"""Every op_db entry (not only tests/test_opinfo.py's list) through braze on the CPU, against
eager: the first 3 samples of each, forward (GRAD=1: and backward), float32 (DTYPE=bfloat16 ...),
static (DYN=1: dynamic=True). Prints WRONG (values differ), ERROR (an exception; check whether
eager or Dynamo raise it too) and TIMEOUT lines; a fallback to ATen is fine. For 16-bit dtypes a
WRONG line says whether braze's result is as close to a float64 reference as eager's (fused
kernels round once where eager rounds per op).

    python benchmarks/opdb_sweep.py [start stop]     # op_db index range

Wrong values from ops whose result depends on storage (as_strided: the harness clones its
input) or is undefined (empty*) are the harness's, not braze's."""
import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("BRAZE_TEST_DEVICE", "cpu")
import torch  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

import test_opinfo as T  # noqa: E402

dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
grad = os.environ.get("GRAD") == "1"
if os.environ.get("DYN") == "1":
    _compile = torch.compile
    torch.compile = lambda fn, **kw: _compile(fn, **{**kw, "dynamic": True})


class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout()


def _sample_fn(op, sample):
    """(a function of the sample's tensors calling `op` with its other arguments, those
    tensors)."""
    args = [sample.input, *sample.args]
    pos = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def fn(*ts):
        a = list(args)
        for k, t in zip(pos, ts):
            a[k] = t
        return op(*a, **sample.kwargs)
    return fn, [args[k] for k in pos]


def _worse_than_eager(eager, got, ref):
    """Whether any of braze's results (`got`) is further from the float64 run's than eager's."""
    worse = False
    for e, g, r in zip(eager, got, ref):
        if e is None or g is None or r is None or not e.dtype.is_floating_point or e.numel() == 0:
            continue
        de = (e.double() - r).abs().nan_to_num(0).max().item()
        dg = (g.double() - r).abs().nan_to_num(0).max().item()
        worse |= dg > de * 1.01 + 1e-12
    return worse


def against_float64(op, sample):
    """'closer' / 'worse' / None: braze's forward error against eager's, both measured from a
    float64 run of the same sample."""
    fn, ts = _sample_fn(op, sample)
    ts = [t.detach() for t in ts]
    up = [t.double() if t.dtype.is_floating_point else t for t in ts]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = T._flatten(fn(*up))
            eager = T._flatten(fn(*[t.clone() for t in ts]))
            torch._dynamo.reset()
            got = T._flatten(torch.compile(fn, backend="braze")(*[t.clone() for t in ts]))
    except Exception:
        return None
    return "worse than eager against float64" if _worse_than_eager(eager, got, ref) else "as close to float64 as eager or closer"


def grads_against_float64(op, sample):
    """As `against_float64`, for the gradients (GRAD=1): the inputs' gradients under one
    cotangent, from braze's and eager's 16-bit runs, each against the
    gradients of a float64 run."""
    fn, ts = _sample_fn(op, sample)

    def grads(ts, run, cots):
        ts = [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]
        outs = [o for o in T._flatten(run(*ts)) if o.requires_grad and o.dtype.is_floating_point]
        if cots is None:
            # Representable in the 16-bit dtype: all three runs take the same cotangent.
            cots = [torch.randn(o.shape, dtype=torch.float64).to(dtype).double() for o in outs]
        torch.autograd.backward(outs, [c.to(o.dtype) for c, o in zip(cots, outs)])
        return [t.grad for t in ts if t.requires_grad], cots
    ts = [t.detach().requires_grad_(t.requires_grad) for t in ts]
    up = [t.detach().double().requires_grad_(t.requires_grad) if t.dtype.is_floating_point else t for t in ts]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref, cots = grads(up, fn, None)
            eager, _ = grads(ts, fn, cots)
            torch._dynamo.reset()
            got, _ = grads(ts, torch.compile(fn, backend="braze"), cots)
    except Exception:
        return None
    if _worse_than_eager(eager, got, ref):
        return "gradients worse than eager's against float64"
    return "gradients as close to float64 as eager's or closer"


def main():
    a, b = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (0, len(op_db))
    signal.signal(signal.SIGALRM, _alarm)
    bad = runs = 0
    for op in op_db[a:b]:
        name = T.full_name(op)
        if dtype not in op.supported_dtypes("cpu") or (grad and not op.supports_autograd):
            continue
        try:
            samples = list(op.sample_inputs("cpu", dtype, requires_grad=grad))[:3]
        except Exception:
            continue
        for i, s in enumerate(samples):
            signal.alarm(60)
            runs += 1
            if os.environ.get("VERBOSE") == "1":  # which sample a crash (segfault) is in
                print("RUN", name, i, flush=True)
            try:
                T._run(op, s, dtype, grad)
            except AssertionError as e:
                bad += 1
                msg = " ".join(str(e).strip().splitlines()[:3])[:300]
                judge = grads_against_float64 if grad else against_float64
                extra = f" [{judge(op, s)}]" if dtype in (torch.bfloat16, torch.float16) else ""
                print("WRONG", name, i, msg + extra, flush=True)
            except Timeout:
                print("TIMEOUT", name, i, flush=True)
            except Exception as e:
                text = str(e).strip()
                print("ERROR", name, i, f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}", flush=True)
            finally:
                signal.alarm(0)
    print(f"done: op_db[{a}:{b}], {runs} runs, {bad} with values unlike eager's")


if __name__ == "__main__":
    main()
