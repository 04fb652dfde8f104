#!/usr/bin/env bash
# A CPU virtual environment with the GPU machine's torch (2.11) and this checkout's braze, to
# see version-specific behaviour (Dynamo's guards, AOTAutograd's graphs) without device time:
#   bash scripts/torch211-venv.sh [dir]        # default /tmp/t211; downloads ~4 GB once
#   /tmp/t211/bin/python -m pytest -q -p no:cacheprovider tests ...
# braze comes from python/ (build the extension first, as the README says); its Dynamo
# backend entry point is declared by a small dist-info written here.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:-/tmp/t211}
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/pip" install -q torch==2.11.0 torchvision==0.26.0 transformers==5.24.0 timm==1.0.31 \
  pytest numpy expecttest hypothesis
site=$("$V/bin/python" -c "import site; print(site.getsitepackages()[0])")
rm -rf "$site"/braze "$site"/braze-*.dist-info
mkdir -p "$site/braze-0.1.0.dist-info"
printf 'Metadata-Version: 2.1\nName: braze\nVersion: 0.1.0\n' > "$site/braze-0.1.0.dist-info/METADATA"
printf '[torch_dynamo_backends]\nbraze = braze.backend:braze_backend\n' > "$site/braze-0.1.0.dist-info/entry_points.txt"
echo "$PWD/python" > "$site/braze.pth"
"$V/bin/python" -c "import torch, braze; print('torch', torch.__version__, 'braze from', braze.__file__)"
