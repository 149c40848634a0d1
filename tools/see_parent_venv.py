"""Make a new venv see the packages of the venv whose Python made it.

`python -m venv --system-site-packages` links the *base* interpreter's site-packages. When that Python is itself a
venv's (a GPU image's /opt/torch/.venv, say, where torch lives), its packages stay out of sight, and an offline
install then looks for torch in the wheelhouse. A .pth file in the new venv appends the parent's site-packages to
sys.path, after the new venv's own, so packages installed here still win.

Usage (by the Python that made the venv): python tools/see_parent_venv.py VENV
"""
import site
import sys
import sysconfig
from pathlib import Path


def main() -> int:
    venv = Path(sys.argv[1]).resolve()
    if sys.prefix == sys.base_prefix:
        return 0  # a plain interpreter: --system-site-packages already sees its packages
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    if not purelib.is_dir():
        sys.exit(f"see_parent_venv: {purelib} is not a directory: is {venv} a venv made by {sys.executable}?")
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "parent-venv.pth").write_text("".join(p + "\n" for p in parents))
    print(f"see_parent_venv: {venv} also sees {', '.join(parents)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
