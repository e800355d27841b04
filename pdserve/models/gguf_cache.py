"""A GGUF checkpoint converted once and kept on disk, so every later start loads it instead of converting again.

The cache file is a safetensors file of the tensors `GGUFCheckpoint` serves (Hugging Face names and
row order), in one of two forms: "float" (every tensor dequantized to float32, what `quantization
none` builds from) or "packed" (Q4_0/Q4_1/Q8_0 matrices as blocks, the rest float32: what the CPU
default builds from), with the config and vocabulary in its header. Its name is the GGUF's content
hash (XXH3-128), the converter's version and the form. Invariant: a cache file serves exactly what
the GGUF would; one that is torn, altered or of another version is never read (the header and a
checksum of the data are checked) but rebuilt, and files are written under a temporary name and
renamed, so no reader sees half a file. PDSERVE_CACHE_DIR moves the cache ("off": no cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from pdserve.models.gguf_file import GGUFCheckpoint, GGUFVocab
from pdserve.models.hf_config import ModelLoadError
from pdserve.models.quant.blocks import BlockFormat, PackedWeight

logger = logging.getLogger(__name__)

# Bump when what GGUFCheckpoint serves changes (names, row order, dequantization): old files are then misses.
CONVERTER_VERSION = 1
CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"
MAX_CACHE_BYTES = 2 << 30  # bigger conversions are not kept (a 7B model in float32 would take 28 GB)
FORMATS_BY_LABEL: Mapping[str, BlockFormat] = {block_format.label: block_format for block_format in BlockFormat}


def cache_dir(environ: Mapping[str, str] = os.environ) -> Optional[Path]:
    """Where converted checkpoints live: $PDSERVE_CACHE_DIR, else the user cache dir; None when "off"."""
    configured = environ.get(CACHE_DIR_ENV)
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve" / "gguf"


def content_hash(path: str) -> str:
    """XXH3-128 of the file's bytes (about 10 GB/s): the file, not its name or date, keys the cache."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return xxhash.xxh3_128_hexdigest(mapped)


class ConvertedGGUF:
    """A `WeightSource` over converted tensors (a cache file or a fresh conversion), with the checkpoint's
    config and vocabulary. A tensor stored in the other form is read from the GGUF itself when asked for."""

    def __init__(self, read: Callable[[str], torch.Tensor], names: frozenset[str], keep_packed: bool,
                 packed: Mapping[str, tuple[str, int]], config: dict[str, Any], vocab: GGUFVocab, gguf_path: str):
        self._read = read
        self._names = names
        self._keep_packed = keep_packed  # the form: packable tensors stored as blocks, or all as floats
        self._packed = packed  # name -> (block format label, in_features) of tensors stored as blocks
        self._config = config
        self._vocab = vocab
        self._gguf_path = gguf_path
        self._checkpoint: Optional[GGUFCheckpoint] = None

    def hf_config(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._config))  # a copy: callers may edit theirs

    def vocab(self) -> GGUFVocab:
        return self._vocab

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise ModelLoadError(f"GGUF file has no tensor for {name!r}")
        return self._original().get(name) if name in self._packed else self._read(name)

    def get_packed(self, name: str) -> PackedWeight | None:
        if name not in self._names:
            raise ModelLoadError(f"GGUF file has no tensor for {name!r}")
        if name not in self._packed:
            return None if self._keep_packed else self._original().get_packed(name)
        label, in_features = self._packed[name]
        return PackedWeight(self._read(name), FORMATS_BY_LABEL[label], in_features)

    def _original(self) -> GGUFCheckpoint:
        if self._checkpoint is None:
            self._checkpoint = GGUFCheckpoint(self._gguf_path)
        return self._checkpoint


def converted_gguf(path: str, keep_packed: bool, directory: Optional[Path] = None) -> ConvertedGGUF | GGUFCheckpoint:
    """The checkpoint at `path` in the form a load with `keep_packed` reads, from the cache when it holds it
    (else converted now and stored); the plain GGUFCheckpoint when the cache is off or the model too big."""
    directory = cache_dir() if directory is None else directory
    if directory is None:
        return GGUFCheckpoint(path)
    form = "packed" if keep_packed else "float"
    key = f"{content_hash(path)}-gguf{_gguf_version()}-v{CONVERTER_VERSION}-{form}"
    file = directory / f"{key}.safetensors"
    cached = read_cache_file(file, key, keep_packed, path)
    if cached is not None:
        logger.info("GGUF conversion read from the cache: %s", file)
        return cached
    checkpoint = GGUFCheckpoint(path)
    if _converted_bytes(checkpoint, keep_packed) > MAX_CACHE_BYTES:
        logger.info("%s converted is over %d bytes: not cached", path, MAX_CACHE_BYTES)
        return checkpoint
    started_s = time.monotonic()
    tensors, packed = convert(checkpoint, keep_packed)
    converted = ConvertedGGUF(tensors.__getitem__, frozenset(tensors), keep_packed, packed, checkpoint.hf_config(),
                              checkpoint.vocab(), path)
    try:
        write_cache_file(file, tensors, _header(key, packed, converted))
    except OSError as exc:
        logger.warning("cannot write the GGUF cache file %s (%s); serving the conversion uncached", file, exc)
    else:
        logger.info("GGUF converted in %.1f s and cached: %s", time.monotonic() - started_s, file)
    return converted


def convert(checkpoint: GGUFCheckpoint, keep_packed: bool) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, int]]]:
    """Every tensor of `checkpoint` as `get` serves it, or as `get_packed` does for blocks when keep_packed."""
    tensors: dict[str, torch.Tensor] = {}
    packed: dict[str, tuple[str, int]] = {}
    for name in checkpoint.tensor_names():
        blocks = checkpoint.get_packed(name) if keep_packed else None
        if blocks is None:
            tensors[name] = checkpoint.get(name).contiguous()
        else:
            tensors[name] = blocks.blocks.contiguous()
            packed[name] = (blocks.format.label, blocks.in_features)
    return tensors, packed


def _header(key: str, packed: Mapping[str, tuple[str, int]], converted: ConvertedGGUF) -> dict[str, str]:
    return {"key": key, "packed": json.dumps(packed), "config": json.dumps(converted.hf_config()),
            "vocab": json.dumps(dataclasses.asdict(converted.vocab()))}


def write_cache_file(file: Path, tensors: Mapping[str, torch.Tensor], header: Mapping[str, str]) -> None:
    """A safetensors file whose header also holds `header` and the XXH3 of its data; written whole, then renamed."""
    raw = safetensors_bytes(dict(tensors))
    header_length = int.from_bytes(raw[:8], "little")
    layout = json.loads(raw[8:8 + header_length])
    data = memoryview(raw)[8 + header_length:]
    layout["__metadata__"] = {**header, "data_xxh3": xxhash.xxh3_128_hexdigest(data)}
    encoded = json.dumps(layout, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors keeps the data 8-byte aligned
    file.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=file.parent, prefix=file.name + ".", suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as f:
            f.write(len(encoded).to_bytes(8, "little"))
            f.write(encoded)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, file)
    except BaseException:
        os.unlink(temporary)
        raise


def read_cache_file(file: Path, key: str, keep_packed: bool, gguf_path: str) -> Optional[ConvertedGGUF]:
    """The converted checkpoint in `file`; None when there is none, and when it is not whole or not of
    `key` (then it is removed, to be rebuilt)."""
    try:
        header = _checked_header(file, key)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("GGUF cache file %s is unusable (%s): converting again", file, exc)
        with contextlib.suppress(OSError):
            file.unlink()
        return None
    except OSError as exc:
        logger.warning("cannot read the GGUF cache file %s (%s): converting again", file, exc)
        return None
    handle = safe_open(str(file), framework="pt")
    vocab = {field: tuple(value) if isinstance(value, list) else value
             for field, value in json.loads(header["vocab"]).items()}
    packed = {name: (label, int(width)) for name, (label, width) in json.loads(header["packed"]).items()}
    return ConvertedGGUF(handle.get_tensor, frozenset(handle.keys()), keep_packed, packed, json.loads(header["config"]),
                         GGUFVocab(**vocab), gguf_path)


def _checked_header(file: Path, key: str) -> dict[str, str]:
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        header_length = int.from_bytes(mapped[:8], "little")
        if not 0 < header_length <= len(mapped) - 8:
            raise ValueError("torn header")
        header = json.loads(mapped[8:8 + header_length])["__metadata__"]
        if header["key"] != key:
            raise ValueError(f"holds {header['key']}")
        if xxhash.xxh3_128_hexdigest(memoryview(mapped)[8 + header_length:]) != header["data_xxh3"]:
            raise ValueError("data checksum differs")
    return header


def _converted_bytes(checkpoint: GGUFCheckpoint, keep_packed: bool) -> int:
    return sum(checkpoint.converted_bytes(name, keep_packed) for name in checkpoint.tensor_names())


def _gguf_version() -> str:
    """The gguf package dequantizes: another version may round otherwise."""
    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return "unknown"
