"""Pack an onnxruntime-gpu wheel small enough to carry to a machine without network (ortlab's GPU checks).

The machines our GPU checks run on reach no package index and take at most 64 MiB a call, while the
onnxruntime-gpu wheel is ~256 MB, most of it one CUDA library whose fatbins hold cubins for every
architecture it supports (sm_75 ... sm_120). This keeps, in each fatbin, only the cubins of one
architecture (``--arch 90`` for the H100/H200), shrinks the fatbin's size field to them and zeroes the
rest, then compresses the library with xz's x86 filter: 1.31.1's 284 MB library became 51 MB, the rest
of the package 11 MB. A fatbin that has no cubin of that architecture is left whole (its kernels could
not run there anyway). On the machine, ``--unpack`` rebuilds the package into a folder to put first
on ``PYTHONPATH`` (Python's lzma and tarfile alone; no xz binary needed).

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        -d /tmp/w onnxruntime-gpu==1.31.1
    python benchmarks/pack_onnxruntime_gpu.py /tmp/w/onnxruntime_gpu-*.whl .gpu --arch 90    # here
    python benchmarks/pack_onnxruntime_gpu.py --unpack .gpu /tmp/site                        # there

The fatbin layout read here (a header with magic 0xBA55ED50, then entries of kind, header size,
payload size and architecture at byte 28) is NVIDIA's undocumented format, as tools that list
fatbins read it; ``cuobjdump --list-elf`` on the result shows what is left. Our own code because no
maintained tool prunes the fatbins of a shared library (``nvprune`` takes object files and static
libraries only).
"""

from __future__ import annotations

import argparse
import io
import lzma
import shutil
import struct
import sys
import tarfile
import zipfile
from pathlib import Path

MAGIC = struct.pack("<I", 0xBA55ED50)
LIBRARY = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
# Not needed to run ortlab on the CUDA provider: TensorRT's provider and the Python tools.
LEFT_OUT = ("onnxruntime/capi/libonnxruntime_providers_tensorrt.so", "onnxruntime/transformers/",
            "onnxruntime/quantization/", "onnxruntime/tools/", "onnxruntime/ThirdPartyNotices.txt")
X86_XZ = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 192 << 20}]


def keep_arch(data: bytearray, arch: int) -> tuple[int, int]:
    """Keep only ``arch``'s cubins in every fatbin of ``data`` (in place); returns (fatbins cut, bytes kept)."""
    pos = cut = kept = 0
    while (i := data.find(MAGIC, pos)) >= 0:
        _, header, size = struct.unpack_from("<HHQ", data, i + 4)
        if header != 16 or size > len(data) - i:
            pos = i + 4
            continue
        entry, end, ours = i + header, i + header + size, []
        while entry < end:
            _, _, entry_header, payload = struct.unpack_from("<HHII", data, entry)
            if struct.unpack_from("<I", data, entry + 28)[0] == arch:
                ours.append(bytes(data[entry:entry + entry_header + payload]))
            entry += entry_header + payload
        if ours:
            blob = b"".join(ours)
            data[i + header:end] = blob + bytes(size - len(blob))
            struct.pack_into("<Q", data, i + 8, len(blob))
            cut, kept = cut + 1, kept + len(blob)
        pos = end
    return cut, kept


def pack(wheel: Path, out: Path, arch: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rest = io.BytesIO()
    with zipfile.ZipFile(wheel) as zf, tarfile.open(fileobj=rest, mode="w") as tf:
        for item in zf.infolist():
            if item.is_dir() or item.filename == LIBRARY or item.filename.startswith(LEFT_OUT):
                continue
            info = tarfile.TarInfo(item.filename)
            info.size, info.mode = item.file_size, (item.external_attr >> 16) or 0o644
            tf.addfile(info, io.BytesIO(zf.read(item)))
        library = bytearray(zf.read(LIBRARY))
    cut, kept = keep_arch(library, arch)
    (out / "rest.tar.xz").write_bytes(lzma.compress(rest.getvalue(), filters=X86_XZ))
    (out / "cuda.so.xz").write_bytes(lzma.compress(bytes(library), filters=X86_XZ))
    sizes = {p.name: p.stat().st_size for p in out.glob("*.xz")}
    print(f"{cut} fatbins cut to sm_{arch} ({kept / 1e6:.1f} MB of cubins kept); {sizes}")


def unpack(packed: Path, site: Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(packed / "rest.tar.xz") as tf:
        tf.extractall(site)
    target = site / LIBRARY
    with lzma.open(packed / "cuda.so.xz") as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    target.chmod(0o755)
    print(f"onnxruntime-gpu unpacked into {site}: put it first on PYTHONPATH")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the wheel (or, with --unpack, the packed folder)")
    parser.add_argument("target", type=Path, help="the packed folder (or, with --unpack, the site folder)")
    parser.add_argument("--arch", type=int, default=90, help="the SM architecture to keep (90: H100, H200)")
    parser.add_argument("--unpack", action="store_true", help="rebuild the package on the GPU machine")
    args = parser.parse_args(argv)
    if args.unpack:
        unpack(args.source, args.target)
    else:
        pack(args.source, args.target, args.arch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
