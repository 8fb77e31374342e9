"""Jobs: submit-time planning, the shard runner, the in-process runner, reports."""

from vlmbatch.job.dryrun import DryRunReport, dry_run
from vlmbatch.job.local import run_in_process, run_job_locally
from vlmbatch.job.parts import pending_shards
from vlmbatch.job.plan import check_model, load_llm, plan_job
from vlmbatch.job.report import print_dry_run, print_errors, print_summary
from vlmbatch.job.shard import ShardOutcome, run_shard

__all__ = [
    "DryRunReport", "ShardOutcome", "check_model", "dry_run", "load_llm", "pending_shards",
    "plan_job", "print_dry_run", "print_errors", "print_summary", "run_in_process", "run_job_locally", "run_shard",
]
