"""Pre-training heads, one file per method; importing this package registers them (see registry.py)."""

from pretrieve.models.heads import costa, cotmae, cotmote, dupmae, mlm, retromae, seed  # noqa: F401
from pretrieve.models.heads.registry import METHODS, Method, get_method, register_method  # noqa: F401
