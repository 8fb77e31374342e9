"""Random-weight checkpoints of a benchmark shape written to disk, bf16 or a published FP8 layout, one shard at a time.

`shapes.save_random_checkpoint` builds the whole `transformers` model and saves it: fine
up to a few billion parameters, impossible for Qwen2.5-VL-72B (146 GB in bf16, more
than the GPU and than the device's disk). Here the tensor names and shapes come from the
model built on the meta device, and each shard's tensors are drawn (on the GPU where there
is one), quantized when asked, written and freed before the next: host memory holds one
shard. Tensors keep the names `transformers` holds them by. FP8 layouts are those of `testing.fp8_checkpoints` (the tiny checkpoints' rewrite):
`fp8-block` as Qwen's `-FP8` releases, `fp8-dynamic` as llm-compressor's `-FP8-dynamic`,
mixture-of-experts weights one expert per tensor. A 72B FP8 checkpoint written so is what
`bench engine --model DIR --no-reference` loads through the product's streaming loader.

Where the model folder's filesystem cannot hold every shard (77 GB on a machine with a
64 GiB disk), the shards that do not fit go to overflow directories on other filesystems
(`/dev/shm`) and are linked from the folder by name: the layout of the Hugging Face cache,
whose snapshot folders link into its blob store, so loaders follow such links anyway.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmbatch.bench.shapes import ModelShape, write_model_folder
from vlmbatch.testing.fp8_checkpoints import FORMATS, FUSED_EXPERTS, quantization_config, quantized_tensors, quantizes

QUANTIZATIONS = ("none", *FORMATS)
SHARD_BYTES = 4 << 30
INIT_STD = 0.02  # transformers' initializer_range of these models
KEEP_FREE = 1 << 30  # left free on each filesystem a shard goes to (the folder's small files, the system's own)


@dataclass(frozen=True)
class Parameter:
    """One tensor `transformers` holds, drawn whole and written as it is, or as its FP8 layout's tensors."""

    name: str
    shape: tuple[int, ...]

    def parts(self, quantization: str) -> list[tuple[str, tuple[int, ...], bool]]:
        """(name, shape, in FP8) of each weight it is stored as: itself, or under an FP8
        layout one per expert of a fused expert tensor ([experts, out, in] held; gate rows
        before up rows), each expert in FP8 as both layouts store them."""
        fused = FUSED_EXPERTS.match(self.name)
        if quantization == "none":
            return [(self.name, self.shape, False)]
        if not fused:
            return [(self.name, self.shape, quantizes(self.name))]
        experts, rows, columns = self.shape
        names = ("gate_proj", "up_proj") if fused["name"] == "gate_up_proj" else ("down_proj",)
        return [(f"{fused['prefix']}.{e}.{name}.weight", (rows // len(names), columns), True) for e in range(experts) for name in names]

    def bytes(self, quantization: str) -> int:
        """What `tensors` writes, worked out on the meta device (no data)."""
        drawn = torch.empty(self.shape, dtype=torch.bfloat16, device="meta")
        return sum(t.numel() * t.element_size() for t in self.tensors(quantization, drawn).values())

    def tensors(self, quantization: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of `weight` (this parameter's drawn value)."""
        parts = self.parts(quantization)
        pieces = weight.reshape(-1, *parts[0][1]) if len(parts) > 1 else [weight]
        out: dict[str, torch.Tensor] = {}
        for (name, _, fp8), piece in zip(parts, pieces):
            out.update(quantized_tensors(quantization, name, piece) if fp8 else {name: piece})
        return out


def model_parameters(folder: Path) -> list[Parameter]:
    """The parameters `transformers` builds for the folder's config, tied ones once, under
    the names it holds them by (its loader and ours also read the older prefixes that
    published checkpoints carry)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    text = config.get_text_config()
    parameters = [Parameter(name, tuple(tensor.shape)) for name, tensor in model.named_parameters()]
    for parameter in parameters:  # the per-expert split assumes [experts, out, in]
        fused = FUSED_EXPERTS.match(parameter.name)
        if fused and parameter.shape[1] != (2 * text.moe_intermediate_size if fused["name"] == "gate_up_proj" else text.hidden_size):
            raise ValueError(f"{parameter.name} is held as {parameter.shape}, not [experts, out, in]")
    return parameters


@dataclass
class Shard:
    parameters: list[Parameter]
    nbytes: int  # what its file holds, less the safetensors header


def plan_shards(parameters: list[Parameter], quantization: str, shard_bytes: int = SHARD_BYTES) -> list[Shard]:
    """Parameters in order, cut into shards of at most `shard_bytes` (a larger tensor alone)."""
    shards = [Shard([], 0)]
    for parameter in parameters:
        nbytes = parameter.bytes(quantization)
        if shards[-1].parameters and shards[-1].nbytes + nbytes > shard_bytes:
            shards.append(Shard([], 0))
        shards[-1].parameters.append(parameter)
        shards[-1].nbytes += nbytes
    return shards


def free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def place_shards(sizes: Sequence[int], homes: Sequence[Path], room: Callable[[Path], int] = free_bytes,
                 keep_free: int = KEEP_FREE) -> list[Path]:  # fmt: skip
    """The directory each shard is written to: the first of `homes` (the model folder, then
    the overflow directories) with room for it, `keep_free` kept on each filesystem (homes
    on one filesystem share its room). Refused before anything is written when they cannot
    hold every shard, saying what each could take."""
    filesystem = {home: os.stat(home).st_dev for home in homes}
    left = {filesystem[home]: room(home) - keep_free for home in homes}
    placed = []
    for size in sizes:
        home = next((h for h in homes if left[filesystem[h]] >= size), None)
        if home is None:
            offered = ", ".join(f"{h} {max(room(h) - keep_free, 0) / 2**30:.1f}" for h in homes)
            raise OSError(f"the checkpoint needs {sum(sizes) / 2**30:.1f} GiB in {len(sizes)} shards of up to "
                          f"{max(sizes) / 2**30:.1f} GiB; free GiB ({keep_free / 2**30:.0f} GiB kept on each): {offered}. "
                          "Add an overflow directory on another filesystem (--overflow).")
        left[filesystem[home]] -= size
        placed.append(home)
    return placed


def draw(parameter: Parameter, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Norm weights 1, biases 0, the rest normal(0, INIT_STD): what `transformers` initializes."""
    if parameter.name.endswith(".bias"):
        return torch.zeros(parameter.shape, dtype=torch.bfloat16, device=device)
    if len(parameter.shape) == 1 and "norm" in parameter.name:
        return torch.ones(parameter.shape, dtype=torch.bfloat16, device=device)
    values = torch.empty(parameter.shape, dtype=torch.bfloat16, device=device)
    return values.normal_(0.0, INIT_STD, generator=generator)


def write_random_checkpoint(shape: ModelShape, root: Path, quantization: str = "none", *, shard_bytes: int = SHARD_BYTES,
                            seed: int = 0, device: torch.device | None = None, overflow: Sequence[Path] = (),
                            room: Callable[[Path], int] = free_bytes, echo: Callable[[str], None] = print) -> Path:  # fmt: skip
    """`root/<shape>`: the model folder (`write_model_folder`) with random weights in
    safetensors shards and their index, in `quantization`'s layout (`QUANTIZATIONS`).
    Shards the folder's filesystem has no room for (`room`) go to `<shape>` in the first
    `overflow` directory that has, each linked from the folder under its name (`place_shards`)."""
    from safetensors.torch import save_file

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = write_model_folder(shape, root)
    shards = plan_shards(model_parameters(folder), quantization, shard_bytes)
    spills = [directory / folder.name for directory in overflow]
    for directory in spills:
        directory.mkdir(parents=True, exist_ok=True)
    homes = place_shards([shard.nbytes for shard in shards], [folder, *spills], room)
    generator = torch.Generator(device).manual_seed(seed)
    weight_map, total = {}, 0
    for number, (shard, home) in enumerate(zip(shards, homes), 1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: tensor.contiguous().cpu() for parameter in shard.parameters
                   for name, tensor in parameter.tensors(quantization, draw(parameter, generator, device)).items()}
        (folder / filename).unlink(missing_ok=True)  # an earlier run's file or link: never written through
        save_file(tensors, str(home / filename), metadata={"format": "pt"})
        if home != folder:
            (folder / filename).symlink_to((home / filename).resolve())
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, filename))
        echo(f"wrote {filename}{'' if home == folder else f' in {home}'}: {len(tensors)} tensors, {total / 2**30:.1f} GiB so far")
        del tensors
    for directory in spills:
        if not any(directory.iterdir()):
            directory.rmdir()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if quantization != "none":
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = quantization_config(quantization)
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    return folder
