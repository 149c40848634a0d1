"""pretrieve: pre-training retrieval-oriented encoders at scale, and measuring them."""

__version__ = "0.1.0"
