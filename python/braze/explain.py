"""``braze.explain(fn)(*args)``: what braze did with a function.

Reports Dynamo's graphs and graph breaks (with reasons), then, per graph braze compiled,
its kernels (with the ops each fuses), the ops that ran through ATen, the islands that ran
through PyTorch (higher-order operators, asserts), and the compile time
of each stage, and whether it runs through braze's direct autograd path or AOTAutograd's
runtime wrappers (and why); graphs that ran eagerly are listed with the reason.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ExplainOutput:
    graph_count: int
    graph_break_count: int
    break_reasons: list
    graphs: list  # braze records

    def __str__(self):
        lines = [f"Dynamo graphs: {self.graph_count}, graph breaks: {self.graph_break_count}"]
        for r in self.break_reasons:
            lines.append(f"  break: {r}")
        for g in self.graphs:
            if g["status"] == "eager":
                lines.append(f"graph {g['name']}: ran eagerly: {g['reason']}")
                continue
            t = g["times"]
            stages = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
            lines.append(f"graph {g['name']}: {len(g['kernels'])} kernel(s); compile: {stages}{' (cached)' if g['cached'] else ''}")
            if "runtime" in g:
                lines.append(f"  runs through {g['runtime']}")
            for name, roots in g["kernels"]:
                lines.append(f"  kernel {name} (stores {', '.join(roots)})")
            why = g.get("extern_reasons", {})
            for op, n in g["externs"].items():
                lines.append(f"  ATen: {op} x{n}" + (f" ({why[op]})" if why.get(op) else ""))
            for op, n in g.get("islands", {}).items():
                kind = ("subgraphs compiled by braze, chosen at run time" if op.endswith("[compiled]") else
                        "higher-order operator" if op.startswith("higher_order.") else "call without a tensor result")
                lines.append(f"  PyTorch island: {op} x{n} ({why.get(op, kind) if why.get(op) not in (None, 'no lowering') else kind})")
        return "\n".join(lines)


def explain(fn, mode=None, options=None):
    import torch

    from .backend import stats

    def run(*args, **kwargs):
        torch._dynamo.reset()
        ex = torch._dynamo.explain(fn)(*args, **kwargs)
        torch._dynamo.reset()
        start = len(stats.records)
        kw = {}
        if mode is not None:
            kw["mode"] = mode
        if options is not None:
            kw["options"] = options
        torch.compile(fn, backend="braze", **kw)(*args, **kwargs)
        reasons = [getattr(b, "reason", str(b)) for b in ex.break_reasons]
        return ExplainOutput(ex.graph_count, ex.graph_break_count, reasons, stats.records[start:])

    return run
