#!/usr/bin/env bash
# Creates the TorchRec peer benchmark's virtual environment, outside the repository (about
# 5 GB: PyPI's torch brings the CUDA libraries it links against, even to run on CPU).
#
#   bench/peers/torchrec/setup.sh            # venv in ${FTREC_PEER_VENV:-~/.cache/ftrec-peers/torchrec}
#   FTREC_TORCH_INDEX=cpu bench/peers/torchrec/setup.sh   # CPU-only torch (about 1 GB), needs
#                                            # the PyTorch CPU index to be reachable
#
# Re-running it is cheap: pip keeps what is already installed at the pinned version.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${FTREC_PEER_VENV:-${HOME}/.cache/ftrec-peers/torchrec}"
python="${PYTHON:-python3.11}"

if ! command -v "$python" >/dev/null; then
    echo "setup.sh: $python not found (the pins are for CPython 3.11; set PYTHON=...)" >&2
    exit 1
fi
case "$(uname -m)" in
    x86_64) ;;
    *) echo "setup.sh: the pinned fbgemm-gpu-cpu wheel is for x86_64, not $(uname -m)" >&2; exit 1 ;;
esac

requirements="$here/requirements.txt"
index_args=()
if [ "${FTREC_TORCH_INDEX:-pypi}" = cpu ]; then
    requirements="$here/requirements-cpu.txt"
    index_args=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
# --no-deps: the requirements file is the whole environment (see its header for why pip
# must not resolve torchrec's dependencies itself).
"$venv/bin/python" -m pip install --disable-pip-version-check --no-deps \
    "${index_args[@]}" -r "$requirements"
"$venv/bin/python" -c 'import torch, torchrec, fbgemm_gpu; print("torch", torch.__version__, "torchrec", torchrec.__version__, "fbgemm_gpu", fbgemm_gpu.__version__)'
echo "ready: $venv"
