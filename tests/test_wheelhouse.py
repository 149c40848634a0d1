"""tools/wheelhouse.py's choices, on pip's report format: which resolved packages a target lacks, and which
platform tags a manylinux target takes. The whole tool, with pip and a network namespace, runs in
tests/test_offline_install.py."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "wheelhouse.py"
spec = importlib.util.spec_from_file_location("wheelhouse", TOOL)
wheelhouse = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelhouse)

LINUX_312 = wheelhouse.marker_environment("3.12", "manylinux_2_28_x86_64")


def _report(**requires: list[str]) -> dict:
    """A pip installation report resolving these packages, {name: its Requires-Dist}."""
    return {"install": [{"metadata": {"name": name.replace("_", "-"), "version": "1.0", "requires_dist": deps}}
                        for name, deps in requires.items()]}


RESOLVED = _report(
    pretrieve=["torch>=2.4", "deepspeed", "fsspec[http]>=2023.12", "faiss-cpu; extra == 'cpu'",
               "pywin32; platform_system == 'Windows'", "tomli; python_version < '3.11'"],
    deepspeed=["torch", "hjson", "sympy"],  # sympy: also torch's, which the target has
    torch=["sympy", "filelock", "nvidia-cublas; platform_system == 'Linux'"],
    fsspec=["aiohttp; extra == 'http'", "requests; extra == 'http'"],
    aiohttp=["yarl"], faiss_cpu=["numpy"], numpy=[], hjson=[], sympy=["mpmath"], mpmath=[], filelock=[],
    nvidia_cublas=[], requests=[], yarl=[], pywin32=[], tomli=[])


def _selected(roots, have, target_has=None) -> list[str]:
    """The packages chosen, less pretrieve itself (the root: main() leaves the checkout out)."""
    chosen = [item["metadata"]["name"] for item in wheelhouse.select(RESOLVED, roots, have, LINUX_312, target_has)]
    return [name for name in chosen if name != "pretrieve"]


def test_what_the_target_has_and_all_it_depends_on_are_left_out():
    assert _selected([("pretrieve", set())], {"torch"}) == ["aiohttp", "deepspeed", "fsspec", "hjson", "requests",
                                                           "yarl"]
    # nothing had: torch and all of its own, the Linux-only one included; never Windows' or Python 3.10's
    assert _selected([("pretrieve", set())], set()) == ["aiohttp", "deepspeed", "filelock", "fsspec", "hjson",
                                                        "mpmath", "nvidia-cublas", "requests", "sympy", "torch",
                                                        "yarl"]


def test_an_extra_asked_of_a_had_package_still_brings_its_own_dependencies():
    assert _selected([("pretrieve", {"cpu"})], {"torch", "fsspec", "deepspeed"}) == [
        "aiohttp", "faiss-cpu", "numpy", "requests", "yarl"]
    assert _selected([("fsspec", set())], {"fsspec"}) == []


def test_manylinux_2_28_takes_every_older_glibc_and_the_legacy_names():
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_29_x86_64" not in tags
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert wheelhouse.platform_tags("linux_x86_64") == ["linux_x86_64"]
    assert LINUX_312["platform_machine"] == "x86_64" and LINUX_312["python_version"] == "3.12"


def test_a_known_target_list_brings_in_what_a_had_package_would_depend_on_but_the_target_lacks():
    # the GPU image's torch came without sympy (a resolution here says torch needs it): deepspeed's sympy goes in,
    # with its own mpmath; without the list, torch's dependencies count as had
    assert _selected([("pretrieve", set())], {"torch"}, target_has={"torch", "filelock", "nvidia-cublas"}) == [
        "aiohttp", "deepspeed", "fsspec", "hjson", "mpmath", "requests", "sympy", "yarl"]
    assert "sympy" not in _selected([("pretrieve", set())], {"torch"})
