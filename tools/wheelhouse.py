"""Download the wheels of pretrieve and of its dependencies into a directory, for an install with no network.

    python tools/wheelhouse.py --out wheelhouse [--python-version 3.12 --platform manylinux_2_28_x86_64]
                               [--have torch==2.11.0,triton,...] [--extras cpu] [--build deepspeed]

`make wheelhouse` runs it; `make install WHEELHOUSE=wheelhouse` installs from it with `pip --no-index
--find-links` (docs/offline.md). Run from the repository root, with a Python that has pip and `packaging`.

1. The --build packages, published as source only (DeepSpeed), become wheels: `pip wheel --no-deps`, DeepSpeed
   with DS_BUILD_OPS=0, so a pure-Python wheel whose ops are compiled just in time on the target.
2. pip resolves `.[EXTRAS]`, the project's build requirements and the --have packages together for the target
   (`--dry-run --report`: metadata alone, no wheel is fetched), the pinned --have entries as constraints.
3. What the target has is left out: the --have packages and everything they depend on (an installed package
   came with its dependencies). Their extras are not: `fsspec[http]` still brings aiohttp when fsspec is had.
4. The rest is downloaded (`pip download --no-deps`, the resolved versions) and the wheelhouse replaces --out
   whole, so it never holds wheels of an earlier set. The wheels and their total size are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the TOML reader pip itself carries
    from pip._vendor import tomli as tomllib

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ModuleNotFoundError:
    sys.exit("tools/wheelhouse.py needs the `packaging` library: python -m pip install packaging")

LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}  # PEP 600's aliases


def target_options(python_version: str | None, platform: str | None) -> list[str]:
    """pip's options that make it choose wheels, and wheels for the target instead of this machine (none: this
    machine). pip takes a manylinux tag literally, so manylinux_2_28 is given with every older glibc
    (manylinux_2_17 and manylinux2014 wheels install on a glibc 2.28 system too)."""
    if not (python_version or platform):
        return ["--only-binary=:all:"]  # a source distribution would need building on the target
    options = ["--only-binary=:all:", "--implementation", "cp"]
    if python_version:
        options += ["--python-version", python_version]
    for tag in platform_tags(platform) if platform else []:
        options += ["--platform", tag]
    return options


def platform_tags(platform: str) -> list[str]:
    if not platform.startswith("manylinux_2_"):
        return [platform]
    glibc, _, arch = platform[len("manylinux_2_"):].partition("_")
    tags = []
    for minor in range(int(glibc), 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in LEGACY_MANYLINUX:
            tags.append(f"{LEGACY_MANYLINUX[minor]}_{arch}")
    return tags


def marker_environment(python_version: str | None, platform: str | None) -> dict[str, str]:
    """The values of environment markers (`platform_system == 'Linux'`) on the target."""
    env = default_environment()
    if python_version:
        env.update(python_version=python_version, python_full_version=f"{python_version}.0",
                   implementation_name="cpython", platform_python_implementation="CPython")
    if platform:
        if "linux" not in platform:
            sys.exit(f"--platform {platform}: only Linux targets (manylinux_*, musllinux_*, linux_*) are supported")
        arch = platform.split("_", 3)[-1] if platform.startswith(("manylinux_", "musllinux_")) else \
            platform.split("_", 1)[1]
        env.update(sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=arch)
    return env


def pip(*args: str, env: dict | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], env=env)
    if done.returncode != 0:
        sys.exit(f"tools/wheelhouse.py: `pip {' '.join(args)}` failed (exit {done.returncode})")


def report(*args: str) -> dict:
    """pip's installation report of a dry run (`pip install --dry-run --report`, pip 22.2 or later): what it
    would install into an empty --target (without one, pip 23 refuses another platform's wheels)."""
    with tempfile.TemporaryDirectory() as tmp:
        pip("install", "--dry-run", "--target", f"{tmp}/target", "--quiet", "--report", f"{tmp}/report.json", *args)
        return json.loads(Path(tmp, "report.json").read_text())


def build_requirements(project: Path) -> list[str]:
    """What pip installs to build the project (pyproject.toml's [build-system]); an offline install of the
    checkout builds it in an isolated environment that sees only the wheelhouse."""
    pyproject = project / "pyproject.toml"
    table = tomllib.loads(pyproject.read_text()).get("build-system", {}) if pyproject.is_file() else {}
    return table.get("requires", ["setuptools>=40.8.0"])


def build_source_only(names: list[str], specifiers: dict[str, str], out: Path, constraints: list[str],
                      cross: bool) -> None:
    """Wheels of the packages published as source only, into OUT. For another target they must be pure Python:
    a compiled wheel built here would be for this machine."""
    env = {**os.environ, "DS_BUILD_OPS": "0"}  # DeepSpeed: no op compiled now; each is built when first used
    for name in names:
        before = set(out.iterdir())
        pip("wheel", "--no-deps", "--no-cache-dir", "--no-binary", name, "--wheel-dir", str(out), *constraints,
            f"{name}{specifiers.get(canonicalize_name(name), '')}", env=env)
        for wheel in set(out.iterdir()) - before:
            tags = parse_wheel_filename(wheel.name)[3]
            if cross and not any(tag.abi == "none" and tag.platform == "any" for tag in tags):
                sys.exit(f"{wheel.name}: {name} built for this machine, not for the target; build it on the "
                         "target's kind of machine and put the wheel into the wheelhouse")


def requirements_of(item: dict, extras: set[str], env: dict, named: set[str]):
    """(name, extras, extra_only) of each requirement of a resolved package that holds on the target with these
    extras, limited to the packages pip resolved (`named`); extra_only: it holds only because of an extra."""
    for text in item["metadata"].get("requires_dist", []):
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        holds = requirement.marker is None or any(requirement.marker.evaluate({**env, "extra": extra})
                                                  for extra in extras | {""})
        if name in named and holds:
            yield name, set(requirement.extras), requirement.marker is not None and not \
                requirement.marker.evaluate({**env, "extra": ""})


def select(resolved: dict, roots: list[tuple[str, set[str]]], have: set[str], env: dict,
           target_has: set[str] | None = None) -> list[dict]:
    """The resolved packages the target lacks: reached from the roots through packages that are not had.
    A had package brings its own dependencies, but not those of an extra asked of it; where the target's package
    list is known (`target_has`), only those of its dependencies that the list names."""
    items = {canonicalize_name(item["metadata"]["name"]): item for item in resolved["install"]}
    present, stack = set(), [name for name in have if name in items]
    while stack:
        name = stack.pop()
        if name not in present and (name in have or target_has is None or name in target_has):
            present.add(name)
            stack += [dep for dep, _, _ in requirements_of(items[name], set(), env, set(items))]
    needed, seen, stack = set(), set(), list(roots)
    while stack:
        name, extras = stack.pop()
        if (name, frozenset(extras)) in seen:
            continue
        seen.add((name, frozenset(extras)))
        had = name in present
        needed |= set() if had else {name}
        stack += [(dep, dep_extras) for dep, dep_extras, extra_only in
                  requirements_of(items[name], extras, env, set(items)) if extra_only or not had]
    return [items[name] for name in sorted(needed)]


def download(items: list[dict], out: Path, options: list[str]) -> None:
    """The resolved version of each package, into OUT (a wheel built into OUT already is found there)."""
    pins = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in items]
    pip("download", "--no-deps", "--dest", str(out), "--find-links", str(out), *options, *pins)


def print_sizes(out: Path, label: Path) -> None:
    wheels = sorted(out.glob("*.whl"), key=lambda wheel: -wheel.stat().st_size)
    total = sum(wheel.stat().st_size for wheel in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    print(f"{label}: {len(wheels)} wheels, {total / 2**20:.1f} MiB ({total:,} bytes)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("wheelhouse"), help="the wheelhouse (replaced whole)")
    parser.add_argument("--project", type=Path, default=Path("."), help="pretrieve's checkout")
    parser.add_argument("--python-version", help="the target's Python, e.g. 3.12 (default: this one)")
    parser.add_argument("--platform", help="the target's platform tag, e.g. manylinux_2_28_x86_64 "
                                           "(default: this machine)")
    parser.add_argument("--have", default="", help="comma-separated packages the target has, each a name or a "
                                                   "pinned requirement (torch==2.11.0); they are left out")
    parser.add_argument("--target-has", type=Path, help="a file naming every package the target has (one a line, "
                                                         "# comments): a had package's dependency outside it goes in")
    parser.add_argument("--extras", default="", help="comma-separated extras of pretrieve to include (dev,cpu)")
    parser.add_argument("--build", default="deepspeed", help="comma-separated packages published as source "
                                                             "only, built into wheels here")
    return parser.parse_args(argv)


def package_names(path: Path) -> set[str]:
    """The package names of a list file, one a line, `#` starting a comment."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line}


def split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def wanted(args: argparse.Namespace, staging: Path) -> list[dict]:
    """Steps 1 to 3: the source-only packages built into STAGING, the resolution, the packages the target lacks
    (pip's report entries), pretrieve itself not among them (the checkout is installed)."""
    project = args.project.resolve()
    options = target_options(args.python_version, args.platform)
    env = marker_environment(args.python_version, args.platform)
    have, extras = [Requirement(entry) for entry in split(args.have)], set(split(args.extras))
    had = {canonicalize_name(r.name) for r in have}
    constraints_file = staging / "constraints.txt"
    constraints_file.write_text("".join(f"{r}\n" for r in have if r.specifier or r.url))
    constraints = ["--constraint", str(constraints_file)]
    metadata = report("--no-deps", str(project))["install"][0]["metadata"]
    specifiers = {canonicalize_name(r.name): str(r.specifier)
                  for r in map(Requirement, metadata.get("requires_dist", []))}
    build_source_only([name for name in split(args.build) if canonicalize_name(name) not in had], specifiers,
                      staging, constraints, cross=bool(args.python_version or args.platform))
    builds = build_requirements(project)
    root = f"{project}[{','.join(sorted(extras))}]" if extras else str(project)
    # the had packages are resolved too, only to learn what they depend on (the target has that as well)
    resolved = report(*options, "--find-links", str(staging), *constraints, root, *builds, *map(str, have))
    constraints_file.unlink()
    name = canonicalize_name(metadata["name"])
    target_has = None if args.target_has is None else package_names(args.target_has)
    found = select(resolved, [(name, extras)], had, env, target_has)
    # the build requirements go in even when the target has them: an isolated build sees only the wheelhouse
    found += select(resolved, [(canonicalize_name(Requirement(b).name), set()) for b in builds], set(), env)
    return list({canonicalize_name(item["metadata"]["name"]): item for item in found
                 if canonicalize_name(item["metadata"]["name"]) != name}.values())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        download(wanted(args, staging), staging, target_options(args.python_version, args.platform))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print_sizes(out, args.out)

if __name__ == "__main__":
    main()
