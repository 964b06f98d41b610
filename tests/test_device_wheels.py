"""``launch/device_wheels.sh``: the wheels carried to the lent GPU machine (no network there). Offline checks: what it
pins (``--list``) is megatron-core 0.16.1, ModelOpt 0.47.0 and none of the packages the device image has
(``launch/device_packages.txt``); ``--check`` refuses, in one line each, a need neither the wheels nor the device
meet, a device version a need excludes, two versions of one name, a wheel the device cannot run, and a budget
overrun. (Downloading them is the script's own run, on a machine with network.)"""
from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ENV, ROOT

SCRIPT = ROOT / "launch" / "device_wheels.sh"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages() -> dict[str, str]:
    """name -> recorded version ('' when none) from launch/device_packages.txt."""
    found = {}
    for line in (ROOT / "launch" / "device_packages.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, ver = line.partition("==")
            found[norm(name)] = ver
    return found


def script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=60)


def test_pins_are_the_two_oracles_and_nothing_the_device_has():
    proc = script("--list")
    assert proc.returncode == 0, proc.stderr
    pins = [line.split("==") for line in proc.stdout.split()]
    assert all(len(p) == 2 and p[1] for p in pins), proc.stdout
    main = {norm(n): v for n, v in pins if "/" not in n}
    assert len(main) == len([n for n, _ in pins if "/" not in n]), "two versions of one name: the install breaks"
    assert main["megatron-core"] == "0.16.1" and main["nvidia-modelopt"] == "0.47.0"
    assert ["mcore19/megatron-core", "0.19.2"] in pins
    device = device_packages()
    assert {"torch", "transformers", "safetensors", "numpy", "pyyaml", "rich", "psutil"} <= set(device)
    assert device["torch"] == "2.11.0"
    assert not set(main) & set(device), f"fetched though the device has them: {set(main) & set(device)}"
    assert script("--bogus").stderr.strip() == \
        "device_wheels.sh: unknown argument --bogus (expected --list or --check)"


def test_wheel_dir_is_ignored():
    """The wheels travel only where a device call carries them (never committed, nor in every call's tree)."""
    ignored = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()]
    assert "/.whl/" in ignored or ".whl/" in ignored


def wheel(where: Path, filename: str, *requires: str) -> None:
    name, ver = filename.split("-")[:2]
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, ver, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(where / filename, "w") as z:
        z.writestr(f"{name}-{ver}.dist-info/METADATA", meta)


def check(where: Path, budget_mib: int = 48) -> subprocess.CompletedProcess:
    return script("--check", env={"WHL_DIR": str(where), "PY": sys.executable, "WHEEL_BUDGET_MIB": str(budget_mib)})


@pytest.mark.parametrize("case, needle", [
    ("met", None),
    ("unmet", "alpha needs beta==2.*, which neither"),
    ("device_too_old", "alpha needs torch>=2.12, the device has 2.11.0"),
    ("two_versions", "two versions of beta"),
    ("cp311", "alpha-1.0-cp311-cp311-manylinux_2_28_x86_64.whl does not run on the device"),
    ("on_device", "rich is on the device already"),
    ("over_budget", "over the budget: drop the largest, alpha-1.0-py3-none-any.whl"),
])
def test_check_refuses_what_would_fail_on_the_device(tmp_path, case, needle):
    """Markers are judged for the device (Python 3.12, Linux x86-64) and extras left out."""
    alpha = "alpha-1.0-cp311-cp311-manylinux_2_28_x86_64.whl" if case == "cp311" else "alpha-1.0-py3-none-any.whl"
    wheel(tmp_path, alpha, "torch>=2.12" if case == "device_too_old" else "torch>=2.6", "beta==2.*",
          'gamma; extra == "dev"', 'delta; python_version < "3.8"', 'megatron-core; sys_platform == "darwin"')
    if case != "unmet":
        wheel(tmp_path, "beta-2.0-py3-none-any.whl")
    if case == "two_versions":
        wheel(tmp_path, "beta-2.1-py3-none-any.whl")
    if case == "on_device":
        wheel(tmp_path, "rich-13.0-py3-none-any.whl")
    if case == "over_budget":
        with zipfile.ZipFile(tmp_path / alpha, "a") as z:
            z.writestr("alpha/blob.bin", b"\0" * 2**20 + b"x")  # stored, not compressed: over a 1 MiB budget
    proc = check(tmp_path, budget_mib=1 if case == "over_budget" else 48)
    if needle is None:
        assert proc.returncode == 0, proc.stderr
        assert (f"--no-compile --no-cache-dir --upgrade --target /tmp/site {tmp_path}/*.whl && "
                "export PYTHONPATH=/tmp/site") in proc.stdout
        assert "MiB  in all" in proc.stdout
    else:
        assert proc.returncode == 1
        errors = proc.stderr.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith("device_wheels.sh: ") and needle in errors[0], proc.stderr
