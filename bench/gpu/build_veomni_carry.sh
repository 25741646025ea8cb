#!/usr/bin/env bash
# Builds the VeOmni wheel kit that bench/gpu/veomni_probe.py needs on the H200 machine (no network
# there), on top of the verl kit of bench/gpu/build_verl_carry.sh. Usage:
#   bench/gpu/build_veomni_carry.sh [OUTDIR]     (default: .veomnicarry; keep it git-ignored, e.g. via
#                                                 .git/info/exclude, like .verlcarry)
# Needs pip and network here. Prints the kit's size and the verl + VeOmni total.
#
# What is in it and why (measured on the CPU machine with verl 0.9.1, torch 2.13 CPU, transformers
# 5.17.0, peft 0.21.0 and the verl kit's pins):
# - veomni 0.1.12 (py3-none-any, ~1.8 MiB; Requires-Python >=3.11,<3.13). Not 0.1.11, the version
#   verl 0.9.1's `veomni-sft` extra pins: 0.1.11's generated Qwen3 modeling (from transformers 5.2.0)
#   calls create_causal_mask(cache_position=...), which transformers 5.17 (the H200 image's) rejects
#   with "TypeError: create_causal_mask() got an unexpected keyword argument 'cache_position'".
#   0.1.12's (from transformers 5.9.0) does not pass it, and verl 0.9.1's VeOmni engine builds and
#   trains with it. VEOMNI_VERSION=0.1.11 builds the pinned one (then run with MODELING_BACKEND=hf).
# - nothing else: veomni's Requires-Dist (blobfile, datasets<=2.21.0, torchdata, tiktoken, psutil,
#   timm, wandb, setuptools, einops, matplotlib) is not imported on verl's language-model path;
#   `import veomni, verl.workers.engine.veomni` plus the Qwen3 modeling imported no top-level module
#   that the verl kit and the image (torch, transformers, peft, psutil, numpy, ...) lack. The kit is
#   installed with --no-deps, so its declared datasets<=2.21.0 does not fight the verl kit's 4.4.1.
#   EXTRA="einops==0.8.1 ..." adds wheels if the GPU run shows an ImportError.
set -euo pipefail
OUT="${1:-.veomnicarry}"
PY="${PYTHON:-python3}"
VEOMNI_VERSION="${VEOMNI_VERSION:-0.1.12}"
read -r -a EXTRA_PKGS <<< "${EXTRA:-}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/*.whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d "$OUT" "veomni==$VEOMNI_VERSION" "${EXTRA_PKGS[@]}"
# What the wheel declares (for the record; the probe prints what actually imports).
"$PY" - "$OUT"/veomni-"$VEOMNI_VERSION"-*.whl <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
core = [l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Dist:") and "extra ==" not in l]
print("veomni", next(l.split(":", 1)[1].strip() for l in lines if l.startswith("Version:")),
      "| Requires-Python", next((l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Python:")), "-"))
print("  core Requires-Dist (not carried, not imported on verl's path):", ", ".join(core))
PYEOF
ls -l "$OUT"
du -cb "$OUT"/*.whl | tail -1 | awk '{printf "kit: %.1f MiB\n", $1/1048576}'
VERL_KIT="${VERL_KIT:-.verlcarry}"
if compgen -G "$VERL_KIT/*.whl" > /dev/null; then
  du -cb "$VERL_KIT"/*.whl "$OUT"/*.whl | tail -1 | awk -v v="$VERL_KIT" '{printf "with the verl kit (%s): %.1f MiB\n", v, $1/1048576}'
fi
