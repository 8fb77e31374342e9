"""`submit --dry-run`: every row's media opens and every prompt fits, nothing generated."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmbatch.config import MediaConfig
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.job.prepare import media_loader_for, prepare_row

MAX_EXAMPLES = 100


@dataclass
class DryRunReport:
    dataset: str
    rows: int = 0
    rows_failed: int = 0
    errors_by_type: Counter = field(default_factory=Counter)
    examples: list[tuple[int, str, str]] = field(default_factory=list)
    startup_s: float = 0.0  # opening the dataset and loading the processor
    elapsed_s: float = 0.0  # everything, start-up included

    @property
    def rows_per_s(self) -> float:
        """Validation throughput, start-up excluded (it does not grow with the dataset)."""
        return self.rows / max(self.elapsed_s - self.startup_s, 1e-9)


def dry_run(
    dataset: str | Path,
    model: str,
    *,
    columns: Any = None,
    sampling: SamplingParams | None = None,
    media_io_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
    storage_options: dict[str, Any] | None = None,
    media: MediaConfig | None = None,
) -> DryRunReport:
    """Validate every row with the model's processor (no weights are loaded), loading media
    as a process configured with `media` would (default: the built-in configuration)."""
    from vlmbatch.io.readers import open_dataset
    from vlmbatch.job.plan import check_media_io_kwargs
    from vlmbatch.families.registry import load_adapter

    started = time.perf_counter()
    reader = open_dataset(dataset, columns, storage_options=storage_options)
    media = media or MediaConfig()
    check_media_io_kwargs(media_io_kwargs or {}, media)
    adapter = load_adapter(model, chat_template=chat_template)
    defaults = sampling or SamplingParams()
    loader = media_loader_for(dataset, media_io_kwargs, media, storage_options)
    report = DryRunReport(dataset=str(dataset), startup_s=time.perf_counter() - started)
    for batch in reader.iter_rows():
        for row_id, raw in batch:
            item = prepare_row(row_id, raw, reader.columns, defaults, adapter, loader, check_only=True)
            report.rows += 1
            if item.error is not None:
                report.rows_failed += 1
                report.errors_by_type[item.error.error_type] += 1
                if len(report.examples) < MAX_EXAMPLES:
                    report.examples.append((row_id, item.error.error_type, item.error.message))
    report.elapsed_s = time.perf_counter() - started
    return report
