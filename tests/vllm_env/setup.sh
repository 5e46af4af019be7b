#!/usr/bin/env bash
# The environment that runs tests/test_vllm_installed.py and tests/test_ep_vllm*.py: a venv at
# $1 (default .venv-vllm) that sees this Python's packages (torch 2.14.1 and resident_pg's
# editable install) and adds vLLM 0.33.0 with the packages that importing its distributed layer
# and its modular MoE kernel needs, pinned in
# requirements.txt and installed without their dependencies, so that vLLM's own pin
# (torch 2.14.0) never replaces the torch resident_pg was built against.
set -euo pipefail
venv=${1:-.venv-vllm}
python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q --no-deps -r "$(dirname "$0")/requirements.txt"
"$venv/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
