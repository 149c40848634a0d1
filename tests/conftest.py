import os
import signal
from pathlib import Path

# Triton kernels run under the interpreter on machines without a GPU; it must be chosen before triton loads.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A pytest-xdist worker (TEST_JOBS: 2 on 2 cores) takes its share of the cores, before torch loads: with a thread
# per core each, the workers oversubscribe the machine and OpenMP's waiting threads spin (tests/test_heads.py's
# in-process training ran 3x slower so). Its subprocesses inherit it unless a test sets their own.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest
from support import SAMPLES, prepare_sample, running_mlflow_server


@pytest.fixture
def sigint_at_default():
    """Children start with SIGINT at its default: under a background job of a non-interactive shell (`make test &`)
    this process inherits it ignored, so would they, and a test sending them SIGINT would prove nothing."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:  # a handler of Python's own: exec sets it back to the default in a child
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="session")
def wiki_shards(tmp_path_factory) -> Path:
    """The bundled Wikipedia sample in shards of 64 samples (648 samples, 11 shards)."""
    out = tmp_path_factory.mktemp("wiki")
    prepare_sample(out, "wikipedia", "wikipedia", shard_size=64)
    return out


@pytest.fixture(scope="session")
def books_shards(tmp_path_factory) -> Path:
    """The bundled books in shards of 16 samples (69 samples, uneven last shard)."""
    out = tmp_path_factory.mktemp("books")
    prepare_sample(out, "books", "books", shard_size=16)
    return out


@pytest.fixture(scope="session")
def vocab():
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend

    return Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))


@pytest.fixture(scope="session")
def llm(tmp_path_factory) -> tuple[Path, Path]:
    """A decoder LLM's tokenizer (`--kind llm`, 4,000 tokens) trained on the Wikipedia sample, and the sample's
    shards made with it: (tokenizer directory, shards directory)."""
    from pretrieve.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer

    out = tmp_path_factory.mktemp("llm")
    train_tokenizer(TokenizerTrainOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")],
                                          out=str(out / "tokenizer"), kind="llm", vocab_size=4000, progress=False))
    prepare_sample(out / "shards", "wikipedia", "wikipedia", tokenizer=str(out / "tokenizer"), shard_size=256)
    return out / "tokenizer", out / "shards"


@pytest.fixture(scope="session")
def wiki_samples(wiki_shards) -> list[dict]:
    """The first 64 samples of a stream over the bundled Wikipedia shards (real text, up to 510 tokens)."""
    from itertools import islice

    from pretrieve.data.stream import ShardStream

    return list(islice(iter(ShardStream([wiki_shards / "manifest.json"], seed=0, shuffle_buffer=64)), 64))


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> Path:
    """A random 2-layer BERT (hidden 64) with the bundled tokenizer, as `pretrieve export` lays it out."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER

    out = tmp_path_factory.mktemp("tiny-encoder")
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)) \
        .save_pretrained(out)
    for file in Path(DEFAULT_TOKENIZER).iterdir():
        shutil.copy(file, out / file.name)
    return out


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on 127.0.0.1 over a sqlite store: (its URL, its process, the store's path)."""
    with running_mlflow_server(tmp_path) as server:
        yield server
