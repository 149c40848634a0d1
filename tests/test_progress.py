import io

from pretrieve.progress import Progress, track


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_without_a_terminal_progress_is_plain_lines_with_eta_every_tenth_or_interval(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("pretrieve.progress.time.monotonic", clock)
    log = io.StringIO()  # not a terminal, as a SLURM log
    with Progress(20, "encode corpus", unit="batch", stream=log, every_s=30.0) as progress:
        for _ in range(20):
            clock.now += 1.0
            progress.update()
        progress.note("a line of its own")
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()  # no bar redrawn in place
    assert lines[0] == "encode corpus: 2/20 batch (10%), 0:00:02 elapsed, ETA 0:00:18"
    assert len([line for line in lines if line.startswith("encode corpus:")]) == 10
    assert lines[-2] == "encode corpus: 20/20 batch (100%), 0:00:20 elapsed, done"
    assert lines[-1] == "a line of its own"

    slow = io.StringIO()  # a large total: the interval, not the tenth, makes the lines
    with Progress(10_000, "farm", unit="job", stream=slow, every_s=30.0) as progress:
        for _ in range(3):
            clock.now += 31.0
            progress.update()
    assert slow.getvalue().splitlines()[0].startswith("farm: 1/10000 job (0%), 0:00:31 elapsed, ETA ")
    assert len(slow.getvalue().splitlines()) == 3


def test_track_yields_every_item_and_is_silent_when_disabled(capsys):
    assert list(track(range(5), "x", enabled=False)) == [0, 1, 2, 3, 4]
    assert capsys.readouterr().err == ""


def test_no_line_comes_after_an_error():
    """A generator counting in a Progress, given up by its consumer's error (`prepare`'s tokenizer stream: closed
    when collected, after the error was printed), or failing itself, prints no last line; one that ends does."""
    log = io.StringIO()

    def counted(fail_at=None):
        with Progress(None, "prepare jsonl", unit="docs", stream=log) as progress:
            for i in range(3):
                if i == fail_at:
                    raise ValueError("bad.jsonl:2: no string field 'text'")
                progress.update()
                yield i

    stream = counted()
    next(stream)
    stream.close()  # GeneratorExit at the yield
    try:
        list(counted(fail_at=1))
    except ValueError:
        pass
    assert log.getvalue() == ""
    assert list(counted()) == [0, 1, 2]
    assert log.getvalue().startswith("prepare jsonl: 3 docs, ")


def test_prepare_prints_nothing_after_its_error(tmp_path, capsys):
    import gc

    from pretrieve.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "hello world"}\n{"id": "b"}\n{"id": "c", "text": "more"}\n')
    assert main(["prepare", "--source", "jsonl", "--input", str(bad), "--out", str(tmp_path / "out"),
                 "--workers", "0"]) == 1
    gc.collect()  # the abandoned tokenizer stream is closed by now
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"pretrieve prepare: error: {bad}:2: no string "
                                                               "field 'text'")


def test_the_last_progress_line_of_training_shows_the_last_steps_loss(capsys):
    """The training loop's progress (no terminal: a line per step of 3) carries the loss logged at that step:
    the last line the loss of step 3, not of step 2, the log step before it."""
    from types import SimpleNamespace

    import torch

    from pretrieve.engine.metrics import MetricsWindow
    from pretrieve.engine.train import _train_steps

    class Engine:
        global_steps, device, module = 0, "cpu", torch.nn.Linear(1, 1)

        def __call__(self, batch):
            return {"loss": torch.tensor(float(self.global_steps + 1))}  # step s: loss s

        def step(self):
            self.global_steps += 1

        backward = lambda self, loss: None  # noqa: E731
        is_gradient_accumulation_boundary = lambda self: True  # noqa: E731
        get_lr = lambda self: [0.1]  # noqa: E731
        zero_optimization = fp16_enabled = bfloat16_enabled = lambda self: False  # noqa: E731
        get_global_grad_norm = lambda self: None  # noqa: E731

    engine = Engine()
    exp = SimpleNamespace(train=SimpleNamespace(max_steps=3, stop_at=None, eval_every=None, log_every=2,
                                              cuda_graphs=False),
                          checkpoint=SimpleNamespace(every=100))
    job = SimpleNamespace(loader=[{"x": torch.zeros(1)}] * 3, count=lambda batch: (1, 1, 1), flops=lambda batch: 0,
                          validation=None, at_step=None, name="finetune contrastive", position=None)
    checkpoints = SimpleNamespace(rank=0, save=lambda step, counters: f"step{step}")
    stop = SimpleNamespace(should_stop=lambda world, device: False)
    _train_steps(exp, job, engine, MetricsWindow(None, None, engine, None), checkpoints,
                 {"samples": 0, "tokens": 0}, stop, 1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("finetune contrastive:")]
    assert len(lines) == 3 and ", loss 1.500, " in lines[1]  # step 2 logs the mean of steps 1 and 2
    assert lines[-1].startswith("finetune contrastive: 3/3 step (100%), ") and ", done, loss 3.000, " in lines[-1]
