"""braze: a torch.compile backend whose compiler and runtime are written in Rust.

    model = torch.compile(model, backend="braze")      # or braze.compile(model)

See ``braze.explain`` to see what braze did with a function, and ``BRAZE_LOGS`` for the
generated code (``output_code``), fusion decisions (``fusion``) and the IR (``graph``).
"""
from __future__ import annotations

from . import _core
from .backend import braze_backend, stats
from .config import MODES, OPTIONS, BrazeConfigError, Config
from .explain import explain

__version__ = _core.__version__
__all__ = ["compile", "explain", "stats", "braze_backend", "BrazeConfigError", "MODES", "OPTIONS"]


def compile(model=None, *, mode=None, options=None, dynamic=None, fullgraph=False):
    """``torch.compile(model, backend="braze", ...)``, with mode and options checked now.

    Unlike ``torch.compile``, which refuses a ``mode`` together with ``options``, both may be
    given: they are bound to braze's backend here rather than passed through Dynamo."""
    import functools

    import torch

    Config.make(mode, options)  # fail early on a bad mode or option
    backend = functools.partial(braze_backend, mode=mode, options=options)
    kw = {"backend": backend, "dynamic": dynamic, "fullgraph": fullgraph}
    if model is None:
        return lambda m: torch.compile(m, **kw)
    return torch.compile(model, **kw)
