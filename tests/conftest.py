import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
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

import psutil
import pytest

from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareOptions


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: a slow end-to-end test of several commands together "
                                       "(`make test-integration`, also run by .ci/run); `make test` leaves it out")
    config.addinivalue_line("markers", "cluster: a test on real cluster parts (a SLURM cluster, network namespaces, "
                                       "fault injection) that needs root (`make test-cluster`, also run by .ci/run)")
    config.addinivalue_line("markers", "parity: a method's losses and gradients against its released code, a checkout "
                                       "and venv named by environment variables (`make test-parity`, "
                                       "tests/parity/released.py); `make test` leaves it out")

SAMPLES = Path(__file__).resolve().parent.parent / "pretrieve" / "assets" / "samples"


TINY_CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def pretrain_env(**extra: str) -> dict:
    """Environment for a `pretrieve pretrain` subprocess: DeepSpeed on CPU, one thread per rank, and none of
    this process's rank variables (the child is its own world, or torchrun sets them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return {**env, **extra}


def pretrain_stopped_and_resumed(config: Path | str, full: list[str], split: list[str], timeout: int = 900) -> None:
    """`pretrieve pretrain` of `config` with the overrides `full` and `split` (which stops early: train.stop_at)
    in one process (tests/train_many.py), then `split` resumed in a fresh process (resume=auto, its stop removed):
    what the exact-resume tests compare. Each run must exit 0."""
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "train_many.py"), str(config),
                           json.dumps([full, split])], env=pretrain_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    resume = [override for override in split if not override.startswith("train.stop_at=")]
    done = subprocess.run([sys.executable, "-m", "pretrieve", "pretrain", str(config), *resume, "resume=auto"],
                          env=pretrain_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def assert_resumed_run_repeats(runs: Path, parts: tuple[str, ...], steps: int = 4) -> None:
    """After pretrain_stopped_and_resumed wrote runs/full and runs/split: the resumed run logs the uninterrupted
    run's step, loss, lr and loss `parts` bit for bit at each of its `steps` steps, and exports the same weights,
    the head's (pretrieve_head.safetensors) included."""
    from safetensors.torch import load_file

    def records(name):
        return [{k: v for k, v in json.loads(line).items() if k in ("step", "loss", "lr", *parts)}
                for line in (runs / name / "metrics.jsonl").read_text().splitlines()]

    full, split = records("full"), records("split")
    assert [r["step"] for r in split] == list(range(1, steps + 1)) and split == full
    for name in ("model.safetensors", "pretrieve_head.safetensors"):
        resumed, uninterrupted = (load_file(runs / run / "export" / name) for run in ("split", "full"))
        assert resumed.keys() == uninterrupted.keys()
        assert all(resumed[k].equal(uninterrupted[k]) for k in resumed)


def exported_after_a_step(head, batch: dict, folder: Path) -> dict:
    """One AdamW step of `head` on `batch`, then its export to `folder`: the export loads in transformers'
    AutoModel as the encoder (the same hidden states), and as a head again with every weight equal; returns the
    reloaded head's state dict (for the method's own keys)."""
    import torch
    from transformers import AutoModel

    from pretrieve.models.export import export, load_export

    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    head(batch)["loss"].backward()
    optimizer.step()
    out = export(head.eval(), folder)
    hf = AutoModel.from_pretrained(str(out), local_files_only=True).eval()
    with torch.no_grad():
        ours = head.encoder(batch["input_ids"], batch["attention_mask"])
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(theirs[real], ours[real], rtol=1e-5, atol=1e-5)
    again = load_export(out).state_dict()
    assert all(torch.equal(again[k], v) for k, v in head.state_dict().items())
    return again


def tiny_head(method: str, *overrides: str):
    """(method, options, head) of configs/pretrain/tiny-`method`.yaml with `overrides`, dropout off, seed 0."""
    from pretrieve.config import load_config
    from pretrieve.pretrain_config import method_options, model_options

    config = load_config(TINY_CONFIGS / f"tiny-{method}.yaml", ["model.dropout=0.0", *overrides])
    spec, options = method_options(config)
    return spec, options, spec.build(options, model_options(config), seed=0)


def collated_with_a_pad_sample(method, options, vocab, samples: list[dict]):
    """(batch, the unmasked ids [B, L]) of `method`'s collator over the first 64 `samples`, the last of them made a
    stream pad sample (no targets)."""
    import torch

    collate = method.collator.from_options(options, vocab, seed=0)
    samples = [*samples[:63], {**samples[63], "pad": True}]
    return collate(samples), torch.from_numpy(collate.pad(samples).ids)


def walk_through_blocks(page: str, heading: str, code_file: str) -> tuple[str, list[str]]:
    """(the section of docs/`page` under `heading`, its python blocks), each block asserted to be `code_file`'s
    code line for line (indentation aside): a walk-through whose code a test runs."""
    def lines(text: str) -> str:
        return "\n".join(line.strip() for line in text.strip().splitlines())

    docs = Path(__file__).resolve().parent.parent / "docs"
    section = (docs / page).read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    for block in blocks:
        assert lines(block) in lines(Path(code_file).read_text()), block
    return section, blocks


def json_lines(stdout: str) -> list:
    """The JSON objects a subprocess printed, one per line, skipping every other line (DeepSpeed and the
    launchers print per rank: warnings)."""
    found = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # not a whole object: a line of another rank or library that happens to start with {
    return found


def result_line(stdout: str) -> dict:
    """The result of a `pretrieve pretrain|finetune` subprocess: its one JSON result line (rank 0 prints it)."""
    [result] = [r for r in json_lines(stdout) if "step" in r]
    return result


def signal_in_mask(pid: int, sig: int, *masks: str) -> bool:
    """Whether `sig` is in any of the named masks of /proc/PID/status (SigCgt: caught; ShdPnd, SigPnd: pending)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return any(int(line.split()[1], 16) >> (sig - 1) & 1 for line in lines if line.split(":")[0] in masks)


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


def ctrl_c_when(proc: subprocess.Popen, ready, timeout: float = 300) -> str:
    """Ctrl-C as a terminal sends it, SIGINT to the process group of `proc` (started in a session of its own),
    once `ready()`; then the end, which must be by SIGINT and without a traceback. Returns the one line of
    stderr that says the command was interrupted."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline and not ready():
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == -signal.SIGINT, err[-3000:]
    said = [line for line in err.splitlines() if "interrupt" in line.lower()]
    assert len(said) == 1 and "Traceback" not in err, err[-3000:]
    return said[0]


def text_methods(methods) -> list[str]:
    """The names of `methods` (registered ones) that train an encoder family on blocks of text, sorted: the
    contrastive method's batches are pairs (tests/test_contrastive.py, tests/test_grad_cache.py), Llama2Vec's
    heads adapt decoder LLMs only (tests/test_llama2vec.py)."""
    return sorted(name for name, method in methods.items()
                  if method.collator.data_kind == "text" and method.head.decoder_llms != "causal")


# how pretrieve named the decoder layers' parameters before the backbone interface (decoder.py's load hook)
OLD_DECODER_NAMES = {"attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
                     "attention.output.dense": "attention_output", "attention.output.LayerNorm": "attention_norm",
                     "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm"}


def old_parameter_name(name: str, method: str) -> str:
    """`name` as pretrieve wrote it before the backbone interface: the base model under `encoder.bert.`, the
    decoder layers' parameters by their short names, and RetroMAE's one layer as the decoder itself."""
    name = name.replace("encoder.model.", "encoder.bert.")
    if name.startswith("decoder."):
        for new, short in OLD_DECODER_NAMES.items():
            name = name.replace(f".{new}.", f".{short}.")
        if method == "retromae":
            name = name.replace("decoder.layers.0.", "decoder.")
    return name


def adamw_steps(head, batch: dict, steps: int, lr: float) -> list[float]:
    """The losses of `steps` AdamW steps of `head` on one fixed batch; after the first backward, every trainable
    weight has a gradient (the loss reaches it) or the list of those without one fails the test."""
    import torch

    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = head(batch)["loss"]
        loss.backward()
        if not losses:
            missing = [n for n, p in head.named_parameters() if p.requires_grad and p.grad is None]
            assert not missing, missing
        optimizer.step()
        losses.append(loss.item())
    return losses


def free_port() -> str:
    """A free TCP port on loopback for a torchrun rendezvous (`--master_port 0` hangs with gloo here)."""
    from pretrieve.engine.world import free_loopback_port

    return str(free_loopback_port())


def prepare_sample(out: Path, source: str, folder: str, **kwargs) -> dict:
    opts = PrepareOptions(source=source, inputs=[str(SAMPLES / folder)], out=str(out), workers=0, **kwargs)
    return prepare(opts)


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


def write_beir(out: Path, data, query_ids: list[str], doc_ids: list[str]) -> Path:
    """A BEIR folder at OUT with those queries of `data` (retrieval.load_beir), their test qrels, and those
    documents."""
    import json

    (out / "qrels").mkdir(parents=True)
    (out / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": data.corpus[d][0],
                                                          "text": data.corpus[d][1]}) + "\n" for d in doc_ids))
    (out / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": data.queries[q]}) + "\n"
                                               for q in query_ids))
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t{r}\n" for q in query_ids for d, r in data.qrels[q].items()))
    return out


def beir_subset(out: Path, queries: int, other_docs: int) -> Path:
    """A BEIR folder at OUT with the bundled SciFact sample's first QUERIES queries, the documents judged for them
    and its first OTHER_DOCS other documents: real text, small enough for a full-size encoder on 2 cores."""
    from pretrieve.data.retrieval import load_beir

    data = load_beir(SAMPLES / "beir" / "scifact-sample")
    query_ids = [q for q in data.queries if q in data.qrels][:queries]
    judged = {d for q in query_ids for d in data.qrels[q]}
    doc_ids = [d for d in data.corpus if d in judged] + [d for d in data.corpus if d not in judged][:other_docs]
    return write_beir(out, data, query_ids, doc_ids)


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on 127.0.0.1 over a sqlite store: (its URL, its process, the store's path)."""
    with running_mlflow_server(tmp_path) as server:
        yield server


# where `mlflow server` keeps its job runner's queue: a folder it makes in /dev/shm and never removes (0.5 MB each)
MLFLOW_JOB_STORE = "_MLFLOW_HUEY_STORAGE_PATH"


@contextlib.contextmanager
def running_mlflow_server(folder: Path):
    """`mlflow server` in `folder` until the block ends: then stopped, and its job store in /dev/shm removed."""
    store, port = folder / "mlflow.db", free_port()
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    if mlflow is None:
        pytest.skip("the mlflow command is not installed beside this interpreter")
    with open(folder / "server.log", "w") as log:  # its own process group: uvicorn and the job runner go with it
        server = subprocess.Popen([mlflow, "server", "--backend-store-uri", f"sqlite:///{store}",
                                   "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1",
                                   "--port", port, "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    url, job_stores = f"http://127.0.0.1:{port}", set()
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as health:
                    if health.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.time() < deadline, (folder / "server.log").read_text()[-3000:]
            time.sleep(0.2)
        job_stores = mlflow_job_stores(server)  # read now: a test may stop the server itself
        yield url, server, store
    finally:
        stop_server(server)
        for path in job_stores | mlflow_job_stores(server):
            shutil.rmtree(path, ignore_errors=True)


def mlflow_job_stores(server: subprocess.Popen) -> set[str]:
    """The job stores the server's processes were handed (its children's environment names them)."""
    found = set()
    try:
        children = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            path = child.environ().get(MLFLOW_JOB_STORE)
        except psutil.Error:
            continue
        if path:
            found.add(path)
    return found


def stop_server(server: subprocess.Popen) -> None:
    """Kill the server's process group, also when it is frozen."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            pass
    server.wait()


def save_tiny_bert(out: Path, hidden: int, intermediate: int) -> Path:
    """A random 2-layer BERT (seed 0, dropout on) with the default tokenizer in `out`: what fine-tuning starts from."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=intermediate)).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER).save_pretrained(str(out))
    return out
