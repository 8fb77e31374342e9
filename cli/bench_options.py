"""Options shared by several `vlmbatch bench` commands, so each is spelled and documented once."""

from __future__ import annotations

from typing import Any

import typer


def model_shape_option(default: Any = "qwen2_5_vl_3b") -> Any:
    """`--model-shape` (alias `--shape`): a registry entry of `vlmbatch.bench.shapes`."""
    return typer.Option(
        default, "--model-shape", "--shape",
        help="Model sizes with random weights, from published configs: qwen2_5_vl_3b (alias 3b), qwen2_5_vl_7b (7b), "
        "qwen2_5_vl_72b (72b), qwen3_vl_8b, qwen3_vl_30b_a3b, internvl3_8b, gemma3_12b, llava_next_7b, "
        "llava_onevision_7b, smolvlm2_2b, smolvlm2_2b_tiled; tiny, tiny_qwen3_vl, tiny_qwen3_vl_moe, tiny_internvl, tiny_gemma3, "
        "tiny_llava_next, tiny_llava_onevision, tiny_smolvlm for CPU smoke runs (vlmbatch/bench/shapes.py).",
    )


def split(value: str) -> tuple[str, ...]:
    """A comma-separated list, blanks dropped."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


def int_list(value: str, flag: str, allow_empty: bool = False) -> tuple[int, ...]:
    """Comma-separated positive integers, or a usage error naming `flag`."""
    try:
        values = tuple(int(part) for part in split(value))
    except ValueError:
        raise typer.BadParameter("expected comma-separated integers", param_hint=flag)
    if (not values and not allow_empty) or min(values, default=1) < 1:
        raise typer.BadParameter("expected positive integers", param_hint=flag)
    return values


def shape_or_exit(name: str) -> Any:
    """The registry entry for `name`, or exit 2 with why it cannot run (unknown, family not available)."""
    from vlmbatch.bench.shapes import ShapeError, resolve_shape

    try:
        return resolve_shape(name)
    except ShapeError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)
