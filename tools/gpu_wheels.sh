#!/usr/bin/env bash
# Wheels for a GPU machine without network access whose image has torch, transformers, triton, numpy, scipy,
# pyyaml, psutil and ninja for Python 3.12, but not what else pretrieve imports on a GPU. This puts those into
# .whl/ (git-ignored through .git/info/exclude), kept small (under 64 MiB) to copy along.
# Run once on a machine with network access, from the repository root; then `tools/gpu_checks.sh` on the GPU
# machine with `.whl/` copied beside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# compiled or binary-only: the device's Python 3.12, manylinux x86-64
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    faiss-cpu==1.15.1 pytrec-eval-terrier==0.5.11 PyStemmer==3.1.0 pydantic-core==2.50.4 pydantic==2.14.3 \
    annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0 omegaconf==2.4.0 webdataset==1.0.2 \
    braceexpand==0.1.7 bm25s==0.3.16
# deepspeed is published as source only; its wheel is pure Python (ops are JIT-built where they run)
"$python" -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
du -sh .whl
