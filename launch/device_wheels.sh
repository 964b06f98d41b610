#!/usr/bin/env bash
# Fetches, here (a machine with network), the wheels the lent GPU machine lacks for the device check
# (launch/gpu_check.sh). That machine (nvidia-h200) has Python 3.12.3, torch 2.11.0 and the packages named in
# launch/device_packages.txt, and no network. Into the ignored .whl/ go exactly: megatron-core 0.16.1
# (tests/oracles/mcore.py and dist_convert itself), nvidia-modelopt 0.47.0 (tests/oracles/spec.py and
# `dist_convert speculate`) and those of their runtime needs (Requires-Dist without extras, recursively) that the
# device does not have, each pinned (the version .venv has), cp312 manylinux x86-64 or pure Python, one version of
# each; and megatron-core 0.19.2 into .whl/mcore19/ (a separate install: two versions in one break it) when it fits.
# Idempotent: a wheel already there is kept. It then checks every wheel's needs are met by .whl/ or the device,
# prints each wheel and its size, fails in one line when .whl/ outgrows WHEEL_BUDGET_MIB (default 48: a device
# call carries at most 64 MiB, the working tree included), and prints the install line.
#
# The one device call names .whl in run's carry and starts its command with that line:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site
# (for megatron-core 0.19.2 instead, a second target ahead of it on PYTHONPATH: the line printed last).
#
# usage: bash launch/device_wheels.sh [--list | --check]
#   --list   print the pinned NAME==VERSION it fetches (mcore19/NAME==VERSION for the optional one); no network
#   --check  only check what .whl/ (or $WHL_DIR) holds: needs, tags, sizes, budget; no network
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# what the device lacks, pinned; a comment says who needs it
PINS=(
  megatron-core==0.16.1            # dist_convert, tests/oracles/mcore.py
  nvidia-modelopt==0.47.0          # tests/oracles/spec.py, dist_convert speculate
  omegaconf==2.3.1                 # nvidia-modelopt
  antlr4-python3-runtime==4.9.3    # omegaconf (==4.9.*); an sdist only: built here into a py3-none-any wheel
  pulp==3.3.2                      # nvidia-modelopt (modelopt.torch.opt.searcher imports it); 16 MB, its CBC solver
  pydantic==2.14.4                 # nvidia-modelopt
  pydantic-core==2.50.5            # pydantic (==2.50.5)
  annotated-types==0.8.0           # pydantic
  typing-inspection==0.4.5         # pydantic
)
SDIST_ONLY=" antlr4-python3-runtime "   # pure Python, no wheel on the registry: `pip wheel` builds one
MCORE19=megatron-core==0.19.2          # optional, into .whl/mcore19/
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
INSTALL="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
W=${WHL_DIR:-.whl}
BUDGET_MIB=${WHEEL_BUDGET_MIB:-48}
MODE=fetch
case "${1:-}" in
  "") ;;
  --list) MODE=list ;;
  --check) MODE=check ;;
  *) echo "device_wheels.sh: unknown argument $1 (expected --list or --check)" >&2; exit 2 ;;
esac

if [ "$MODE" = list ]; then
  printf '%s\n' "${PINS[@]}" "mcore19/$MCORE19"
  exit 0
fi

if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
shopt -s nullglob nocaseglob
stem() { echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/_/g'; }   # a wheel file name's spelling of a name
mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
bytes_of() { local t=0 f; for f in "$@"; do t=$(( t + $(stat -c %s "$f") )); done; echo "$t"; }

# fetch PIN DIR: the wheel of PIN into DIR unless there; other versions of that name in DIR are removed
fetch() {
  local pin=$1 dir=$2 name ver s have log
  name=${pin%%==*} ver=${pin#*==} s=$(stem "$name")
  mkdir -p "$dir"
  have=("$dir/$s-$ver"-*.whl)
  if [ ${#have[@]} -gt 0 ]; then echo "have  ${have[0]}"; return; fi
  for old in "$dir/$s"-*.whl; do echo "drop  $old (another version of $name)"; rm -f "$old"; done
  log=$(mktemp /tmp/device_wheels.XXXXXX.log)
  if [[ "$SDIST_ONLY" == *" $name "* ]]; then
    "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$dir" "$pin" >"$log" 2>&1 \
      || { echo "device_wheels.sh: building a wheel of $pin failed (see $log)" >&2; exit 1; }
  else
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${PLATFORMS[@]}" -d "$dir" "$pin" >"$log" 2>&1 \
      || { echo "device_wheels.sh: pip found no cp312 manylinux x86-64 wheel of $pin (see $log);" \
             "add --platform manylinux_2_N_x86_64 (N up to 39) to PLATFORMS" >&2; exit 1; }
  fi
  rm -f "$log"
  have=("$dir/$s-$ver"-*.whl)
  [ ${#have[@]} -gt 0 ] || { echo "device_wheels.sh: pip saved no $s-$ver-*.whl in $dir for $pin" >&2; exit 1; }
  echo "fetch ${have[0]}"
}

budget=$(( BUDGET_MIB * 1048576 ))
if [ "$MODE" = fetch ]; then
  for pin in "${PINS[@]}"; do fetch "$pin" "$W"; done
  main=$(bytes_of "$W"/*.whl)
  m19=("$W"/mcore19/*.whl)
  if [ ${#m19[@]} -eq 0 ]; then
    tmp=$(mktemp -d /tmp/device_wheels.mcore19.XXXXXX)
    fetch "$MCORE19" "$tmp" >/dev/null
    extra=$(bytes_of "$tmp"/*.whl)
    if [ $(( main + extra )) -le "$budget" ]; then
      mkdir -p "$W/mcore19" && mv "$tmp"/*.whl "$W/mcore19/" && echo "fetch $W/mcore19/ ($MCORE19)"
    else
      echo "skip  $MCORE19: .whl/ would hold $(mib $(( main + extra ))) MiB, over the $BUDGET_MIB MiB budget"
    fi
    rm -rf "$tmp"
  elif [ $(( main + $(bytes_of "${m19[@]}") )) -gt "$budget" ]; then
    echo "drop  $W/mcore19/: with it .whl/ would outgrow the $BUDGET_MIB MiB budget"; rm -rf "$W/mcore19"
  else
    fetch "$MCORE19" "$W/mcore19"
  fi
fi

[ -d "$W" ] || { echo "device_wheels.sh: no $W/ to check; run bash launch/device_wheels.sh first" >&2; exit 1; }
# the working tree that travels with every device call besides the wheels (tracked and untracked, not ignored)
tree=0
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
fi
"$PY" - "$W" launch/device_packages.txt "$budget" "$tree" <<'PY'
"""Every wheel: a tag the device runs, one version of each name, none the device already has, every need
(Requires-Dist whose marker holds on the device, extras left out) met by .whl/ or the device; sizes and budget."""
import os
import sys
import zipfile
from email.parser import HeaderParser

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

w, device_list, budget, tree = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
DEVICE = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
          "platform_release": "", "platform_version": "", "extra": ""}
device: dict[str, str | None] = {}
for line in open(device_list):
    line = line.split("#")[0].strip()
    if line:
        name, _, ver = line.partition("==")
        device[canonicalize_name(name)] = ver or None


def runs_there(tag) -> bool:
    return (tag.interpreter in ("cp312", "py3", "py312") and tag.abi in ("cp312", "abi3", "none")
            and (tag.platform == "any" or (tag.platform.startswith("manylinux") and tag.platform.endswith("x86_64"))))


errors, notes, total, sizes = [], [], 0, []
groups = {"": sorted(f for f in os.listdir(w) if f.endswith(".whl"))}
if os.path.isdir(os.path.join(w, "mcore19")):
    groups["mcore19/"] = sorted(f for f in os.listdir(os.path.join(w, "mcore19")) if f.endswith(".whl"))
main: dict = {}
for group, files in groups.items():
    have: dict = {}
    for f in files:
        name, ver, _, tags = parse_wheel_filename(f)
        if name in have:
            errors.append(f"two versions of {name} in {w}/{group}: keep one")
        have[name] = ver
        if not any(runs_there(t) for t in tags):
            errors.append(f"{f} does not run on the device (cp312 manylinux x86-64 or py3-none-any)")
        if name in device:
            errors.append(f"{name} is on the device already (launch/device_packages.txt): drop it from PINS")
        size = os.path.getsize(os.path.join(w, group, f))
        total += size
        sizes.append((size, group + f))
    if not group:
        main = dict(have)
    reachable = {**main, **have}
    for f in files:
        with zipfile.ZipFile(os.path.join(w, group, f)) as z:
            meta = HeaderParser().parsestr(z.read(next(n for n in z.namelist()
                                                       if n.endswith(".dist-info/METADATA"))).decode())
        for spec in meta.get_all("Requires-Dist") or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate(DEVICE):
                continue
            need, who = canonicalize_name(req.name), parse_wheel_filename(f)[0]
            if need in reachable:
                if not req.specifier.contains(reachable[need], prereleases=True):
                    errors.append(f"{who} needs {spec}, {w}/ has {need} {reachable[need]}: change its pin")
            elif need in device:
                if device[need] is None and req.specifier:
                    notes.append(f"{who} needs {spec}: the device's version is not recorded")
                elif not req.specifier.contains(device[need], prereleases=True):
                    errors.append(f"{who} needs {spec}, the device has {device[need]}: pin {need} in PINS")
            else:
                errors.append(f"{who} needs {spec}, which neither {w}/ nor the device has: add it to PINS")
for size, f in sizes:
    print(f"{size / 2**20:8.2f} MiB  {w}/{f}")
print(f"{total / 2**20:8.2f} MiB  in all (budget {budget / 2**20:.0f} MiB); the working tree "
      f"{tree / 2**20:.2f} MiB more, {(total + tree) / 2**20:.2f} of the 64 MiB a device call carries")
for n in sorted(set(notes)):
    print(f"note: {n}")
if total > budget or total + tree > 64 * 2**20:
    big = ", ".join(f"{f} ({s / 2**20:.1f} MiB)" for s, f in sorted(sizes, reverse=True)[:2])
    errors.append(f"{w}/ holds {total / 2**20:.2f} MiB, over the budget: drop "
                  f"{'mcore19/ or ' if 'mcore19/' in groups else ''}the largest, {big}")
if errors:
    for e in errors:
        print(f"device_wheels.sh: {e}", file=sys.stderr)
    sys.exit(1)
PY
echo "on the device, first:"
echo "  $INSTALL --target /tmp/site $W/*.whl && export PYTHONPATH=/tmp/site"
if [ -d "$W/mcore19" ]; then
  echo "and for megatron-core ${MCORE19#*==} instead of ${PINS[0]#*==} (a namespace package: the first on PYTHONPATH wins):"
  echo "  $INSTALL --target /tmp/site19 $W/mcore19/*.whl && export PYTHONPATH=/tmp/site19:/tmp/site"
fi
