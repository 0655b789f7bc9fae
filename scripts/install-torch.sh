#!/usr/bin/env bash
# Installs PyTorch into an environment for the main job, and says which build and why:
#   bash scripts/install-torch.sh PYTHON
# RVOD_TORCH=cpu (the default): PyTorch's CPU build from its own index (download.pytorch.org/whl/cpu: about
# 200 MB to download, 0.7 GB installed), which is all a CPU job needs. When that index cannot be reached, PyPI's
# torch instead, which on Linux x86_64 is the CUDA build (about 2.5 GB of wheels, 5 GB installed: torch, NVIDIA's
# CUDA libraries and triton); it trains on the CPU just as well.
# RVOD_TORCH=cuda: PyPI's CUDA build, for GPU machines.
# A torch already in the environment is kept, whichever build it is.
set -euo pipefail
PYTHON=${1:?usage: install-torch.sh PYTHON}
CPU_INDEX=https://download.pytorch.org/whl/cpu
choice=${RVOD_TORCH:-cpu}

if installed=$("$PYTHON" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    echo "install-torch: keeping the torch already installed ($installed)" >&2
    exit 0
fi
case "$choice" in
    cpu)
        if "$PYTHON" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
            echo "install-torch: installing PyTorch's CPU build from $CPU_INDEX (RVOD_TORCH=cuda for the CUDA build)" >&2
            "$PYTHON" -m pip install -q torch --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
            exit 0
        fi
        echo "install-torch: $CPU_INDEX cannot be reached from here, so PyPI's torch is installed instead: the" \
             "CUDA build, about 2.5 GB to download; it runs on the CPU as well" >&2 ;;
    cuda)
        echo "install-torch: installing PyPI's torch (the CUDA build, about 2.5 GB), as RVOD_TORCH=cuda asks" >&2 ;;
    *)
        echo "install-torch: RVOD_TORCH is '$choice'; it takes cpu (the default) or cuda" >&2
        exit 2 ;;
esac
"$PYTHON" -m pip install -q torch
