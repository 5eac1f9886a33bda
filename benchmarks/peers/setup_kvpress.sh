#!/usr/bin/env bash
# Build the separate virtual environment that runs NVIDIA kvpress for the peer benchmark.
#
# kvpress 0.5.5 pins transformers < 5.3, while kvpolicy runs on transformers 5.23, so kvpress
# gets its own venv (default: .venv-kvpress at the repository root, git-ignored).
# torch is installed FIRST and pinned: an unpinned torch would pull a multi-GB CUDA build.
#
# Usage: benchmarks/peers/setup_kvpress.sh [VENV_DIR]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-kvpress}"
TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install "torch==$TORCH_VERSION"
# Keep torch where it is while kvpress and its dependencies resolve.
echo "torch==$TORCH_VERSION" > "$VENV/torch-pin.txt"
"$VENV/bin/python" -m pip install -c "$VENV/torch-pin.txt" "kvpress==0.5.5" "transformers>=5.2,<5.3"

"$VENV/bin/python" - "$TORCH_VERSION" <<'PY'
import sys

import kvpress
import torch
import transformers

want = sys.argv[1]
have = torch.__version__.split("+")[0]
if have != want:
    sys.exit(f"torch is {torch.__version__} in the kvpress venv, expected {want}")
print(f"kvpress venv ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"kvpress {getattr(kvpress, '__version__', '0.5.5')}")
PY
