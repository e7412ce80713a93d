#!/usr/bin/env bash
# Install kdtree-engine (editable, with the dev, build and pipeline extras) into the Python
# that runs this, and never replace a torch that is already there.
#   bash tools/setup.sh            PYTHON=python3.11 bash tools/setup.sh
# A machine without torch gets the CPU build ($KDTREE_TORCH_PIN, default
# torch==2.13.0, which machines without a GPU take from their local wheel
# cache); an unpinned torch would pull a multi-GB CUDA build. A machine with
# torch (a GPU machine with SGLang's torch) keeps it: pip then sees the project's
# torch requirement satisfied and leaves it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if have=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  echo "setup: keeping the torch already installed ($have)"
else
  pin=${KDTREE_TORCH_PIN:-torch==2.13.0}
  echo "setup: no importable torch; installing the CPU build $pin"
  "$py" -m pip install "$pin"
fi
"$py" -m pip install -e '.[dev,build,pipeline]'
