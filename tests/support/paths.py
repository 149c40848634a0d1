"""Where the tests find the repository's bundled samples and tiny configurations."""
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"
TINY_CONFIGS = ROOT / "configs" / "pretrain"
