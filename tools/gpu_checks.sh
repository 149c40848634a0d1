#!/usr/bin/env bash
# The checks that need a GPU, on a GPU machine. From the repository root there, with the wheels of `.whl/`
# beside it when that machine has no network access (tools/gpu_wheels.sh fills it):
#   tools/gpu_checks.sh kernels engine     # sections: kernels, engine (each about ten minutes or less)
# kernels: tests/test_kernels_gpu.py (bf16/fp16 parity on real shapes, a fused vs eager decoder step) and
#          benchmarks/two_stream_attention.py (fused vs eager vs SDPA, B 32, H 12, D 64, L 128-1024, bf16).
# engine:  one optimizer step of every method in fp16 (dynamic loss scaling) and bf16 at ZeRO 2, and
#          benchmarks/pretrain_throughput.py for retromae and dupmae, BERT-base, L 512, bf16.
# Results (JSON, logs) go to $OUT when it is set, else gpu-results/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-gpu-results}
mkdir -p "$out"
python=${PYTHON:-python3}
if [[ -d .whl ]]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
status=0
for section in "${@:-kernels}"; do
  case $section in
    kernels)
      "$python" -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tee "$out/kernels-tests.log" || status=1
      "$python" benchmarks/two_stream_attention.py --out "$out/two_stream_attention.json" 2>&1 \
        | tee "$out/two_stream_attention.log" || status=1
      ;;
    engine)
      shards=/tmp/wiki-shards
      "$python" -m pretrieve prepare --source wikipedia --input pretrieve/assets/samples/wikipedia --out "$shards" \
        --shard-size 64 --workers 0 > /dev/null || exit 1
      for precision in fp16 bf16; do
        "$python" tests/one_step.py "/tmp/one-step-$precision" "$shards/manifest.json" \
          mlm,retromae,dupmae,seed,costa,cotmae,cotmote 2 "$precision" 2>&1 | tail -n 20 \
          | tee "$out/one-step-$precision.log" || status=1
      done
      for method in retromae dupmae; do
        "$python" benchmarks/pretrain_throughput.py --method "$method" --size base --seq-len 512 --batch 32 \
          --steps 20 --out "$out/pretrain_throughput.json" 2>&1 | tail -n 3 | tee -a "$out/pretrain_throughput.log" \
          || status=1
      done
      ;;
    *) echo "gpu_checks.sh: unknown section $section (kernels, engine)" >&2; exit 2 ;;
  esac
done
exit $status
