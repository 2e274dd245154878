"""What the GPU machine lacks for the serving check (issue #32), brought in parts small enough to
carry.

The device image (Python 3.12.3, glibc 2.39) has torch, triton, transformers, msgpack, uvloop,
prometheus-client and nvidia-ml-py, but no Ray, no gguf, no llguidance, no
grpcio-health-checking/-reflection, and gRPC/protobuf of other versions (our generated stubs need
protobuf 7 and grpcio >= 1.85). Nothing there reaches a registry, and one `run` carries at most 64
MiB with the working tree (~19 MiB), so here we build, in `.gpu_wheels/` (ignored by git), parts of
at most --part-mib (40 MiB), MANIFEST.json in every one, in this order:

    wheels for any Python: gguf, jsonschema and its needs, protobuf and llguidance (abi3),
        grpcio-health/-reflection
    wheels for the device's Python: Ray as a slimmed tarball (ray/jars, rllib, data, serve, train,
        tune, llm dropped: 79 MB wheel -> 25 MB .tar.xz), grpcio, rpds-py
    the default model's tokenizer alone (its GGUF without tensors, 1.8 MB)
    the default model's GGUF (98 MB, SmolLM2-135M-Instruct.Q4_1.gguf from .venv), split: its
        first pieces end part 1, the rest fills parts 2-4

so part 1 alone serves the 8B shape (a dummy model with the default tokenizer). Here (about 5
minutes, mostly pip's download of Ray and xz):

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/gpu_wheels.py build [--python-version 3.12]

On the device, each call copies its part out of the repo into /tmp/pdserve-gpu/parts (a warm
machine keeps it between calls); `install` checks every complete file's sha256, joins the pieces,
installs into /tmp/pdserve-gpu/site and writes /tmp/pdserve-gpu/env.sh (PYTHONPATH, and
PDSERVE_DEFAULT_MODEL: the model if every part was staged, else its tokenizer alone). The calls are
in scripts/gpu_serve_check.py's docstring. `stage` prints the device's `python -V`: a Python
other than the one built for needs a new build here (`--python-version`) before the next machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = Path(os.environ.get("PDSERVE_GPU_WHEELS_DIR", ROOT / ".gpu_wheels"))
DEVICE_DIR = Path(os.environ.get("PDSERVE_GPU_DIR", "/tmp/pdserve-gpu"))
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the default model's metadata alone (its tokenizer, for the dummy 8B shape; 2 MB against 98)
TOKENIZER_FILE = "SmolLM2-135M-Instruct.tokenizer.gguf"
RAY_VERSION = "2.60.0"
# Ray's packages that serving never imports (Java jars, RL, data, serve, train, tune, llm)
RAY_DROPPED = ("jars", "rllib", "data", "serve", "train", "tune", "llm")
# any Python (pure or abi3); versions = the project's .venv, so the stubs and Ray agree with our
# tests
PORTABLE = (
    "gguf==0.19.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
    "protobuf==7.36.2",
    "llguidance==1.9.1",  # abi3; engine/guided.py imports it with the engine
)
PER_PYTHON = ("grpcio==1.85.3", "rpds-py==2026.9.1")  # compiled for one Python
PLATFORMS = (  # the device's glibc is 2.39 (Ubuntu 24.04's Python 3.12.3); llguidance needs 2.31
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download(specs, dest: Path, python_version: str | None) -> list[Path]:
    """The wheels of `specs` (name==version) in `dest`, downloaded unless already there."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    if python_version:
        command += ["--python-version", python_version, "--implementation", "cp"]
        command += [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([*command, "-d", str(dest), *specs], check=True)
    found = []
    for spec in specs:
        name, version = spec.split("==")
        prefix = f"{name.replace('-', '_').lower()}-{version}-"
        tag = f"cp{python_version.replace('.', '')}" if python_version else ""
        matches = [
            p
            for p in dest.glob("*.whl")
            if p.name.lower().startswith(prefix)
            and (tag in p.name or "-none-" in p.name or "abi3" in p.name)
        ]
        if len(matches) != 1:
            raise SystemExit(f"{spec}: expected one wheel in {dest}, found {matches}")
        found.append(matches[0])
    return found


def _slim_ray(wheel: Path, out: Path) -> None:
    """Ray's wheel without what serving never imports, as a .tar.xz to unpack into site-packages."""
    with tempfile.TemporaryDirectory() as scratch:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(scratch)
            for info in z.infolist():  # extractall drops the modes (raylet, gcs_server must run)
                mode = (info.external_attr >> 16) & 0o777
                if mode and not info.is_dir():
                    Path(scratch, info.filename).chmod(mode)
        for name in RAY_DROPPED:
            shutil.rmtree(Path(scratch, "ray", name), ignore_errors=True)
        tar = subprocess.Popen(
            ["tar", "cf", "-", "-C", scratch, "."], stdout=subprocess.PIPE
        )  # xz -T2: minutes, not ten
        partial = out.with_suffix(".partial")
        with open(partial, "wb") as f:
            subprocess.run(["xz", "-T2", "-9"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise RuntimeError("tar of the slimmed Ray failed")
        partial.rename(out)  # whole or not at all: a rebuild reuses it


def _model_file() -> Path:
    sys.path.insert(0, str(ROOT))
    from engine.default_model import default_model_path

    return default_model_path()


def _tokenizer_only(model: Path, out: Path) -> Path:
    """A GGUF holding `model`'s metadata and no tensors: `--tokenizer default` needs no more."""
    import gguf

    if out.is_file():
        return out
    reader = gguf.GGUFReader(model)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out.with_suffix(".partial"), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the reader's own, and the writer's
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out.with_suffix(".partial").rename(out)
    return out


def _travelling_tree_bytes() -> int:
    """What travels with every call besides the carried paths: tracked and untracked-not-ignored
    files, plus pdserve_proto (carried with the serving check)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [ROOT / name.decode() for name in listed if name]
    paths += list((ROOT / "pdserve_proto").rglob("*"))
    return sum(p.stat().st_size for p in paths if p.is_file())


def build(python_version: str, part_mib: int) -> None:
    """Downloads and packs everything into `.gpu_wheels/part-N/`, the model last."""
    for old in OUT_DIR.glob("part-*"):
        shutil.rmtree(old)
    downloads = OUT_DIR / "downloads"  # kept: a rebuild downloads nothing twice
    downloads.mkdir(parents=True, exist_ok=True)
    files = _pip_download(PORTABLE, downloads, python_version)
    ray_wheel = _pip_download([f"ray=={RAY_VERSION}"], downloads, python_version)[0]
    slim = downloads / f"ray-{RAY_VERSION}-{ray_wheel.name.split('-')[2]}-slim.tar.xz"
    if not slim.is_file():
        _slim_ray(ray_wheel, slim)
    files += [slim, *_pip_download(PER_PYTHON, downloads, python_version)]
    # the model last: part 1 alone serves the 8B shape (tokenizer only); the rest add the model
    model = _model_file()
    files += [_tokenizer_only(model, downloads / TOKENIZER_FILE), model]
    part_bytes = part_mib << 20
    parts: list[list[dict]] = [[]]
    used = 0
    for path in files:
        size = path.stat().st_size
        if used + size > part_bytes and size <= part_bytes and used:  # whole, in the next part
            parts.append([])
            used = 0
        offset = 0
        while offset < size:
            if used == part_bytes:
                parts.append([])
                used = 0
            length = min(size - offset, part_bytes - used)
            parts[-1].append(
                {"file": path.name, "offset": offset, "length": length, "source": str(path)}
            )
            offset += length
            used += length
    manifest = {
        "python_version": python_version,
        "ray": RAY_VERSION,
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
        "parts": [
            [{k: v for k, v in piece.items() if k != "source"} for piece in part] for part in parts
        ],
    }
    for number, part in enumerate(parts, start=1):
        folder = OUT_DIR / f"part-{number}"
        folder.mkdir()
        for piece in part:
            with open(piece["source"], "rb") as src:
                src.seek(piece["offset"])
                data = src.read(piece["length"])
            (folder / f"{piece['file']}.{piece['offset']:012d}").write_bytes(data)
        (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    tree = _travelling_tree_bytes()
    for number in range(1, len(parts) + 1):
        folder = OUT_DIR / f"part-{number}"
        size = sum(f.stat().st_size for f in folder.iterdir())
        warning = "  TOO LARGE with the tree: lower --part-mib" if size + tree > 63 << 20 else ""
        print(f"{folder}: {size / 2**20:.1f} MiB (+ the tree's {tree / 2**20:.1f}){warning}")
    print(f"{len(parts)} parts for CPython {python_version}; carry one per device call")


def stage(number: int) -> None:
    """Device side: copies `.gpu_wheels/part-N` out of the repo, where later calls find it."""
    print(
        f"device: {platform.python_implementation()} {platform.python_version()} ({sys.executable})"
    )
    source = OUT_DIR / f"part-{number}"
    if not source.is_dir():
        raise SystemExit(f"{source} is missing: carry .gpu_wheels/part-{number} in this call")
    manifest = json.loads((source / "MANIFEST.json").read_text())
    if manifest["python_version"] != f"{sys.version_info.major}.{sys.version_info.minor}":
        print(
            f"WARNING: the parts were built for Python {manifest['python_version']}: rebuild here "
            f"with --python-version {sys.version_info.major}.{sys.version_info.minor}"
        )
    target = DEVICE_DIR / "parts"
    target.mkdir(parents=True, exist_ok=True)
    for piece in source.iterdir():
        shutil.copyfile(piece, target / piece.name)
    have = sorted(p.name for p in target.iterdir() if p.name != "MANIFEST.json")
    print(f"staged part {number} of {len(manifest['parts'])}: {len(have)} pieces in {target}")


def _find_piece(name: str) -> Optional[Path]:
    for folder in [DEVICE_DIR / "parts", *sorted(OUT_DIR.glob("part-*"))]:
        if (folder / name).is_file():
            return folder / name
    return None


def install() -> Path:
    """Device side: joins and checks the pieces, installs into DEVICE_DIR/site; returns env.sh."""
    manifests = [DEVICE_DIR / "parts" / "MANIFEST.json", *OUT_DIR.glob("part-*/MANIFEST.json")]
    manifest = json.loads(next(m for m in manifests if m.is_file()).read_text())
    files_dir, site = DEVICE_DIR / "files", DEVICE_DIR / "site"
    files_dir.mkdir(parents=True, exist_ok=True)
    for name, expected in manifest["files"].items():
        joined = files_dir / name
        if joined.is_file() and joined.stat().st_size == expected["bytes"]:
            continue
        pieces = [
            _find_piece(f"{name}.{piece['offset']:012d}")
            for part in manifest["parts"]
            for piece in part
            if piece["file"] == name
        ]
        if None in pieces:
            if name == MODEL_FILE:  # the 8B shape needs only the tokenizer
                print(f"{name}: not every part is staged; serving the tokenizer-only GGUF")
                continue
            raise SystemExit(f"{name}: a piece is in no staged part: stage every part it spans")
        partial = joined.with_name(joined.name + ".partial")  # whole and checked, or not there
        with open(partial, "wb") as out:
            for piece in pieces:
                out.write(piece.read_bytes())
        if _sha256(partial) != expected["sha256"]:
            partial.unlink()
            raise SystemExit(f"{name}: sha256 differs from the manifest (a part got corrupted)")
        partial.rename(joined)
    wheels = sorted(str(p) for p in files_dir.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        + ["--no-cache-dir", "--upgrade", "--target", str(site), *wheels],
        check=True,
    )
    for slim in files_dir.glob("ray-*-slim.tar.xz"):
        with tarfile.open(slim) as tar:
            tar.extractall(site, filter="fully_trusted")
    env = DEVICE_DIR / "env.sh"
    env.write_text(
        f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"export PDSERVE_DEFAULT_MODEL={default_model_file()}\n"
    )
    print(f"installed {len(wheels)} wheels and Ray into {site}; source {env}")
    return env


def default_model_file() -> Path:
    """The installed default model, or its tokenizer alone while the model's parts are missing."""
    files_dir = DEVICE_DIR / "files"
    model = files_dir / MODEL_FILE
    return model if model.is_file() else files_dir / TOKENIZER_FILE


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="here: download and pack into .gpu_wheels/part-N")
    b.add_argument("--python-version", default="3.12", help="the device's (3.12.3 seen in 2026-11)")
    b.add_argument("--part-mib", type=int, default=40, help="with the ~20 MiB tree, under 64 MiB")
    s = sub.add_parser("stage", help="device: keep part N outside the repo")
    s.add_argument("number", type=int)
    sub.add_parser("install", help="device: join, check, install; writes env.sh")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.python_version, args.part_mib)
    elif args.command == "stage":
        stage(args.number)
    else:
        install()
    return 0


if __name__ == "__main__":
    sys.exit(main())
