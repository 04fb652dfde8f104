#!/usr/bin/env bash
# Installs everything braze needs on a fresh machine (Python packages from PyPI, the Rust
# toolchain's crates from crates.io) and builds braze into the current Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v cargo >/dev/null 2>&1; then
  echo "braze needs a Rust toolchain (cargo); install it with rustup" >&2
  exit 1
fi
if ! command -v cc >/dev/null 2>&1 && [ -z "${CC:-}" ]; then
  echo "braze needs a C compiler (cc) for its CPU kernels" >&2
  exit 1
fi
$PY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# Real model code for the model-zoo tests: transformers, timm and torchvision (resolved
# together with torch so torchvision matches it).
$PY -m pip install -q "torch>=2.4" torchvision transformers timm numpy expecttest pytest hypothesis "maturin>=1.5,<2"
# Editable install: Python sources from python/, the Rust extension built in release mode.
$PY -m pip install -q --no-build-isolation -e .
$PY -c "import braze, torch; print('braze', braze.__version__, 'on torch', torch.__version__)"
