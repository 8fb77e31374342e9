"""Launch shapes of the fused MoE's kernels (`fused_moe.py`) and the table that picks them.

The tiles are measured, not guessed: `vlmbatch bench moe --write-table` sweeps candidates
per token count on the H200 and keeps the winners in fused_moe_tuned.json beside this
module, one table per expert-weight format. Shapes never swept get `default_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .fp8 import BLOCK_GROUP as FP8_BLOCK


@dataclass(frozen=True)
class GemmTile:
    """Launch shape of one expert GEMM (BLOCK_M is shared by both and lives in MoeConfig).
    The per-pair kernels of BLOCK_M 1 use block_n, block_k and num_warps, and `mma_rows`:
    0 for the GEMV kernels (`_pair_gate_up_kernel`, `_token_down_kernel`), else the rows of
    the tensor-core tile of their MMA variants (one real row, the rest masked: the weight
    tiles then stream through the software pipeline, num_stages deep, as the grouped GEMMs'
    do, while no sort is needed). `prefetch` (MMA variants, on a CUDA device): each program
    first asks L2 for its whole weight slice (`_prefetch_l2`), so that all of its bytes are
    in flight at once rather than num_stages tiles of them. `split_slots` (the per-token
    down GEMV): 1 gives each of a token's k slots its own programs
    (`_token_down_split_kernel`), k times the programs, each streaming one expert's rows."""

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    mma_rows: int = 0
    prefetch: int = 0
    split_slots: int = 0


@dataclass(frozen=True)
class MoeConfig:
    """block_m: the rows of an expert block of the grouped GEMMs, or 1 for the per-pair kernels."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile


# The tile table measured by `vlmbatch bench moe --write-table` (data beside this module):
# {"hidden,intermediate,num_experts,top_k": {"measured": ..., "configs": {tokens: config}}},
# and with block-FP8 experts (`--experts fp8-block`) under "hidden,...,top_k,fp8-block".
TUNED_TABLE_PATH = Path(__file__).with_name("fused_moe_tuned.json")
EXPERT_FORMATS = ("bf16", "fp8-block")  # the experts' weights a table was measured with


def config_from_json(entry: dict) -> MoeConfig:
    """One config of the tuned table (extra keys such as the measured time are notes)."""
    return MoeConfig(entry["block_m"], GemmTile(**entry["gate_up"]), GemmTile(**entry["down"]))


def table_key(shape: tuple[int, int, int, int], experts: str = "bf16") -> str:
    """The tuned table's key of a shape (hidden, intermediate, num_experts, top_k) and expert format."""
    return ",".join(str(part) for part in (*shape, *([experts] if experts != "bf16" else [])))


def load_tuned_configs(path: Path = TUNED_TABLE_PATH, experts: str = "bf16") -> dict[tuple[int, int, int, int], dict[int, MoeConfig]]:
    """The table of one expert format keyed by (hidden, intermediate, num_experts, top_k), then token count."""
    if not path.exists():
        return {}
    tables = json.loads(path.read_text())
    parsed = {}
    for key, table in tables.items():
        parts = key.split(",")
        if (parts.pop() if not parts[-1].isdigit() else "bf16") == experts:
            parsed[tuple(int(part) for part in parts)] = {int(n): config_from_json(entry) for n, entry in table["configs"].items()}
    return parsed


TUNED_CONFIGS = load_tuned_configs()
TUNED_FP8_CONFIGS = load_tuned_configs(experts="fp8-block")


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoeConfig:
    """A reasonable launch for shapes the table lacks: BLOCK_M near the mean number of rows
    of an expert that has any (padding rows cost reads of nothing but MMA time), narrow
    weight strips while the product is bound by reading weights, square tiles once not."""
    pairs = num_tokens * top_k
    rows_per_expert = pairs / max(1, min(num_experts, pairs))
    if rows_per_expert <= 16:
        return MoeConfig(16, GemmTile(64, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 4))
    if rows_per_expert <= 32:
        return MoeConfig(32, GemmTile(64, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 4))
    if rows_per_expert <= 96:
        return MoeConfig(64, GemmTile(128, 64, 8, 4, 3), GemmTile(128, 64, 8, 4, 3))
    return MoeConfig(128, GemmTile(128, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3))


def choose_config(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, fp8: bool = False) -> MoeConfig:
    """The tuned entry for the smallest swept token count >= num_tokens (the largest beyond
    them), or `default_config` for shapes that were never swept. FP8 experts take the table
    swept with them where there is one, else bf16's (its grouped tiles then go through
    `fp8_tile` at launch)."""
    shape = (hidden, intermediate, num_experts, top_k)
    table = (TUNED_FP8_CONFIGS.get(shape) if fp8 else None) or TUNED_CONFIGS.get(shape)
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    key = min((n for n in table if n >= num_tokens), default=max(table))
    return table[key]


# Widest output tile of a w8a8 grouped GEMM per accumulator: the gated GEMM keeps two (gate,
# up), and each K step's float32 product needs a third tile of registers before it is scaled.
FP8_MAX_BLOCK_N = {True: 64, False: 128}


def fp8_tile(tile: GemmTile, gated: bool) -> GemmTile:
    """A grouped-GEMM tile of the table (measured with bf16 operands) for e4m3 operands: K
    steps of one whole 128-column scale group, which is the shared memory a bf16 step of 64
    columns takes, and half the steps (each scaled once). Its columns are capped
    (`FP8_MAX_BLOCK_N`): with the table's 128-column gate/up and 256-column down tiles of
    128 rows, ptxas ran out of registers (255) and spilled in the main loop (sm_90, session
    16): the likely reason the w8a8 grouped GEMMs lost to bf16 on the H200 (232 against 116
    ms for one 30B-A3B prefill step; capped, 118 ms in session 17). The sweep with FP8
    experts (`bench moe --experts fp8-block`) measures tiles of its own; this maps bf16's
    where no FP8 table is."""
    return replace(tile, block_k=FP8_BLOCK, block_n=min(tile.block_n, FP8_MAX_BLOCK_N[gated]))
