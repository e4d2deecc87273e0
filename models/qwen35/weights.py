"""Reads one rank's slices of a Hugging Face safetensors checkpoint (single file or sharded).

Text weights live under ``model.language_model.`` (multimodal checkpoints) or ``model.`` (text-only
ones); ``lm_head.weight`` is top level. Vision tower (``model.visual.*``) and MTP head (``mtp.*``)
tensors are skipped. Every tensor is read through ``safe_open(...).get_slice`` so a rank touches
only the bytes it keeps, and each file is reopened per tensor so the memory map of a tensor the
rank only partly needs is released before the next one is read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from tqdm import tqdm

from phalanx.models.qwen35.sharding import TensorSpec

log = structlog.get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TEXT_PREFIXES = ("model.language_model.", "model.")
SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.", "visual.")
TOP_LEVEL = ("lm_head.weight",)
MAX_LISTED_PROBLEMS = 8


class WeightError(ValueError):
    """The checkpoint's tensors do not match what the config says the model needs."""


class Checkpoint:
    """Where each text tensor lives and its shape, read from the safetensors headers only."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        files = self._files()
        self.file_of: dict[str, Path] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise WeightError(f"checkpoint file {path} listed in {INDEX_FILE} does not exist")
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if key.startswith(SKIPPED_PREFIXES):
                        continue
                    self.file_of[key] = path
                    self.shape_of[key] = tuple(handle.get_slice(key).get_shape())
        self.prefix = self._text_prefix()

    def _files(self) -> dict[str, Path]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise WeightError(f"{index} has no weight_map")
            return {name: self.model_dir / file for name, file in weight_map.items()}
        single = self.model_dir / SINGLE_FILE
        if single.is_file():
            return {"": single}
        raise WeightError(f"no {SINGLE_FILE} or {INDEX_FILE} in model directory {self.model_dir}")

    def _text_prefix(self) -> str:
        for prefix in TEXT_PREFIXES:
            if any(key.startswith(prefix + "layers.") for key in self.shape_of):
                return prefix
        raise WeightError(
            f"checkpoint in {self.model_dir} has no decoder layers under any of the prefixes {TEXT_PREFIXES}"
        )

    def full_name(self, name: str) -> str:
        return name if name in TOP_LEVEL else self.prefix + name


def check_tensors(
    checkpoint: Checkpoint, specs: Sequence[TensorSpec], *, allow_extra: Sequence[str] = (), rank: int = 0
) -> None:
    """Raise WeightError listing every missing, misshaped and unexpected tensor, with shapes."""
    problems: list[str] = []
    wanted = {checkpoint.full_name(spec.name): spec for spec in specs}
    for full, spec in wanted.items():
        found = checkpoint.shape_of.get(full)
        if found is None:
            problems.append(f"missing tensor {full} (expected shape {list(spec.shape)})")
        elif found != spec.shape:
            problems.append(
                f"tensor {full} has shape {list(found)} in the checkpoint, expected {list(spec.shape)}"
            )
    tolerated = {checkpoint.full_name(name) for name in allow_extra}
    for full, shape in checkpoint.shape_of.items():
        if full not in wanted and full not in tolerated:
            problems.append(f"unexpected tensor {full} with shape {list(shape)} (expected no such tensor)")
    if problems:
        listed = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(listed)
        suffix = f"; and {more} more" if more else ""
        raise WeightError(
            f"rank {rank}: checkpoint in {checkpoint.model_dir} does not match the model config: "
            + "; ".join(listed)
            + suffix
        )


def read_slices(
    checkpoint: Checkpoint,
    specs: Sequence[TensorSpec],
    *,
    dtype: torch.dtype,
    device: torch.device,
    rank: int = 0,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """This rank's part of every spec'd tensor, keyed by ``spec.key`` (fused groups as one tensor).

    Each destination is allocated once, at its final size, dtype and device, and the slices are
    copied straight into it, so the rank never holds a second copy of its weights.
    """
    destinations = _allocate(specs, dtype, device)
    row_offsets: dict[str, int] = {}
    for spec in tqdm(specs, desc=f"rank {rank} loading weights", disable=not progress, unit="tensor"):
        full = checkpoint.full_name(spec.name)
        rows = spec.local_shape[0]
        offset = row_offsets.get(spec.key, 0)
        row_offsets[spec.key] = offset + rows
        target = destinations[spec.key].narrow(0, offset, rows)
        with safe_open(str(checkpoint.file_of[full]), framework="pt") as handle:
            _copy_into(handle.get_slice(full), spec, target)
    log.debug("weights read", rank=rank, tensors=len(specs), model_dir=str(checkpoint.model_dir))
    return destinations


def _allocate(
    specs: Sequence[TensorSpec], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for spec in specs:
        shape = list(spec.local_shape)
        if spec.key in shapes:
            if shapes[spec.key][1:] != shape[1:]:
                raise WeightError(f"cannot fuse {spec.name} {shape} into {spec.key} {shapes[spec.key]}")
            shapes[spec.key][0] += shape[0]
        else:
            shapes[spec.key] = shape
        dtypes[spec.key] = torch.float32 if spec.keep_fp32 else dtype
    return {key: torch.empty(shape, dtype=dtypes[key], device=device) for key, shape in shapes.items()}


def _copy_into(tensor_slice, spec: TensorSpec, target: torch.Tensor) -> None:
    """Copy the spec's ranges of a safetensors slice (a PySafeSlice) into ``target``."""
    if spec.ranges is None:
        target.copy_(tensor_slice[:])
        return
    lead = (slice(None),) * spec.dim
    offset = 0
    for lo, hi in spec.ranges:
        # A slice may be a view into the file's memory map; copy_ reads it once, and the map is
        # released when the file handle closes.
        target.narrow(spec.dim, offset, hi - lo).copy_(tensor_slice[(*lead, slice(lo, hi))])
        offset += hi - lo
