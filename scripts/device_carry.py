"""Prepares the carry for the GPU check: the wheels scripts/device_check.sh needs that the device image lacks.

    python scripts/device_carry.py [--dir .whl]

The device machine reaches no registry, so what its image lacks travels with the working tree as wheels
(64 MiB per call, the tree included) and scripts/device_check.sh installs them first. For each line of
scripts/device_carry.txt this fetches the wheel for the image's Python 3.12 on manylinux x86-64; a package
that exists only as source is built here, and must come out pure Python (py3-none-any) to load there. Then
every carried wheel's requirements are checked against the carry and the image (scripts/device_image.txt):
a requirement met by neither fails here, not on the device. The folder is replaced whole, only when all
of that succeeded. Prints the wheels, their total size and what the call will carry in all.
"""

from __future__ import annotations

import argparse
import email.parser
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the script runs from anywhere
from gradscale.checks import CommandParser  # noqa: E402

CARRY_LIST = ROOT / "scripts" / "device_carry.txt"
IMAGE_LIST = ROOT / "scripts" / "device_image.txt"
CALL_LIMIT = 64 * 2**20  # what one device call may carry: the working tree and the wheels together
PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
# the device's interpreter, for evaluating requirement markers (python_version < "3.9" and the like)
DEVICE_MARKERS = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def read_list(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def pinned(requirement: Requirement) -> str:
    specs = list(requirement.specifier)
    if len(specs) != 1 or specs[0].operator != "==":
        sys.exit(f"device_carry: {CARRY_LIST.name}: '{requirement}' must pin one version (name==X.Y.Z)")
    return specs[0].version


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def fetch(requirement: Requirement, into: Path) -> Path:
    """The wheel for the device's Python: downloaded where the registry has one, else built here."""
    spec = f"{requirement.name}=={pinned(requirement)}"
    before = set(into.glob("*.whl"))
    platform_args = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    got = pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
              "--implementation", "cp", *platform_args, "--dest", str(into), spec)
    how = "downloaded"
    if got.returncode != 0:
        if "No matching distribution" not in got.stderr:
            sys.exit(f"device_carry: pip download {spec} failed:\n{got.stderr.strip()}")
        got = pip("wheel", "--quiet", "--no-deps", "--no-binary=:all:", "--wheel-dir", str(into), spec)
        if got.returncode != 0:
            sys.exit(f"device_carry: no wheel for Python {PYTHON} of {spec}, and building one failed:\n"
                     f"{got.stderr.strip()}")
        how = "built here"
    new = sorted(set(into.glob("*.whl")) - before)
    if len(new) != 1:
        sys.exit(f"device_carry: {spec} gave {len(new)} wheels ({', '.join(p.name for p in new)}), expected one")
    wheel = new[0]
    tags = parse_wheel_filename(wheel.name)[3]
    if how == "built here" and not any(tag.abi == "none" and tag.platform == "any" for tag in tags):
        sys.exit(f"device_carry: {wheel.name} was built for this machine's Python {sys.version.split()[0]}, "
                 f"not pure Python: it would not load on the device's {PYTHON}")
    print(f"  {wheel.name}: {how}", flush=True)
    return wheel


def requirements_of(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    return [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]


def unmet_requirements(wheels: list[Path], image: list[Requirement]) -> list[str]:
    """Each carried wheel's requirements, on the device's Python, that neither the carry nor the image meets."""
    carried = {canonicalize_name(parse_wheel_filename(w.name)[0]): parse_wheel_filename(w.name)[1] for w in wheels}
    in_image = {canonicalize_name(r.name) for r in image}
    problems = []
    for wheel in wheels:
        for requirement in requirements_of(wheel):
            if requirement.marker is not None and not requirement.marker.evaluate(DEVICE_MARKERS):
                continue
            name = canonicalize_name(requirement.name)
            if name in carried:
                if not requirement.specifier.contains(carried[name], prereleases=True):
                    problems.append(f"{wheel.name} needs {requirement}; the carry has {name} {carried[name]}")
            elif name not in in_image:
                problems.append(f"{wheel.name} needs {requirement}: neither carried nor in the image "
                                f"(add it to {CARRY_LIST.name})")
    return problems


def tree_bytes() -> int:
    """What else travels with a call: tracked files, and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return sum((ROOT / name).stat().st_size for name in listed if name and (ROOT / name).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python scripts/device_carry.py", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="example: python scripts/device_carry.py && "
                                  "scripts/device_rehearsal.sh")
    parser.add_argument("--dir", type=Path, default=ROOT / ".whl",
                        help="where the wheels go (default .whl, which git ignores); replaced whole")
    args = parser.parse_args(argv)
    wanted, image = read_list(CARRY_LIST), read_list(IMAGE_LIST)
    for requirement in wanted:
        pinned(requirement)  # every line checked before anything is fetched
    dest = args.dir.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"device_carry: fetching {len(wanted)} wheels for Python {PYTHON} on manylinux x86-64 into {dest} "
          "(about 10 s; a source-only package is built)", flush=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f"{dest.name}.tmp") as tmp:  # .whl.tmp*: ignored
        staging = Path(tmp) / "wheels"
        staging.mkdir()
        wheels = [fetch(requirement, staging) for requirement in wanted]
        problems = unmet_requirements(wheels, image)
        if problems:
            sys.exit("device_carry: the carry is incomplete:\n  " + "\n  ".join(problems))
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    wheels = sorted(dest.glob("*.whl"))
    total, tree = sum(w.stat().st_size for w in wheels), tree_bytes()
    width = max(len(w.name) for w in wheels)
    for wheel in wheels:
        print(f"  {wheel.name:<{width}}  {wheel.stat().st_size / 2**20:6.2f} MiB")
    print(f"carry: {len(wheels)} wheels, {total / 2**20:.2f} MiB; with the working tree ({tree / 2**20:.1f} MiB) "
          f"a call carries {(total + tree) / 2**20:.1f} MiB of its {CALL_LIMIT // 2**20} MiB")
    if total + tree > CALL_LIMIT:
        sys.exit(f"device_carry: {(total + tree) / 2**20:.1f} MiB is over the {CALL_LIMIT // 2**20} MiB a call carries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
