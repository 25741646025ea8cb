#!/usr/bin/env bash
# Builds the wheel kit that bench/gpu/verl_check.sh installs on the H200 machine (no network there):
# verl 0.9.1 and what it imports that the machine's image lacks, cp312 manylinux x86_64, with Ray's
# 32 MB Java jar removed from its wheel (no Ray cluster is started) and antlr4 4.9.3 built from
# its sdist. Usage: bench/gpu/build_verl_carry.sh [OUTDIR]   (default: .verlcarry, git-ignored via
# .git/info/exclude). Needs pip and network here. Prints the kit's size (must stay <= 60 MiB).
set -euo pipefail
OUT="${1:-.verlcarry}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/*.whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Pinned so their own requirements agree with each other and with the machine's image (pyarrow,
# huggingface-hub, typing-extensions, packaging are the image's).
PKGS=(verl==0.9.1 ray==2.55.1 tensordict==0.10.0 pyvers==0.1.0 importlib-metadata==8.7.0 orjson==3.11.3
      hydra-core==1.3.2 omegaconf==2.3.0 codetiming==1.4.0 pylatexenc==2.11 torchdata==0.11.0
      datasets==4.4.1 dill==0.4.0 multiprocess==0.70.18
      jsonschema==4.25.1 referencing==0.36.2 rpds-py==0.27.1 jsonschema-specifications==2025.9.1
      fastapi==0.116.1 starlette==0.47.2 uvicorn==0.35.0
      pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.1
      lazy-importer==0.1.0 opentelemetry-api==1.36.0 tzdata==2025.2)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" -d "$OUT" "${PKGS[@]}"
# antlr4-python3-runtime 4.9.3 (hydra's parser) exists only as an sdist: build a wheel here.
TMP="$(mktemp -d)"
"$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$TMP" antlr4-python3-runtime==4.9.3
cp "$TMP"/antlr4_python3_runtime-4.9.3-*.whl "$OUT"/
# Ray without its Java jar: drop ray/jars/ray_dist.jar and its RECORD line (pip checks RECORD hashes
# of files it installs only; a RECORD line for a missing file would fail the install).
RAY="$(ls "$OUT"/ray-2.55.1-*.whl)"
"$PY" - "$RAY" "$TMP/ray.whl" <<'PYEOF'
import sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if item.filename.endswith("ray/jars/ray_dist.jar"):
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(keepends=True) if not l.startswith(b"ray/jars/ray_dist.jar,"))
        zout.writestr(item, data)
PYEOF
mv "$TMP/ray.whl" "$RAY"
rm -rf "$TMP"
ls -l "$OUT"
du -cb "$OUT"/*.whl | tail -1 | awk '{printf "kit: %.1f MiB\n", $1/1048576}'
