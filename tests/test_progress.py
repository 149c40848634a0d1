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
