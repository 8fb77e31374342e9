"""Configuration is read at the edges and passed down (issue 13): no module below them
reads the environment, and `vlmbatch worker` hands its configuration to each worker
process on the command line instead of through the environment."""

from __future__ import annotations

import os

from typer.testing import CliRunner

from package_source import modules
from vlmbatch.config import EngineConfig, MediaConfig, QueueConfig, WorkerConfig

# The edges: the commands, a worker process at start-up and its supervisor, `LLM(...)`,
# and the test harnesses.
EDGE_PREFIXES = ("vlmbatch.cli", "vlmbatch.testing")
EDGE_MODULES = {"vlmbatch.workers.process", "vlmbatch.workers.supervisor", "vlmbatch.engine.llm"}
ENV_MARKERS = ("os.environ", "os.getenv", "environ[", "putenv", "getenv(")


def test_only_the_edges_read_the_environment() -> None:
    readers = {}
    for name, path in modules().items():
        if name.startswith(EDGE_PREFIXES) or name in EDGE_MODULES:
            continue
        lines = path.read_text().splitlines()
        hits = [number for number, line in enumerate(lines, 1) if any(marker in line for marker in ENV_MARKERS)]
        if hits:
            readers[name] = hits
    assert not readers, f"the environment is read below the edges (module: lines): {readers}"


def test_a_worker_process_gets_its_configuration_on_its_command_line() -> None:
    """What `vlmbatch worker` built is what each process rebuilds; only the core share
    comes in the process's environment, one share per process."""
    from vlmbatch.workers.process import ProcessConfigs, parse_args
    from vlmbatch.workers.supervisor import Supervisor, pinned_env

    configs = ProcessConfigs(
        engine=EngineConfig(engine="hf", dtype="float32", attention_backend="torch", gpu_image_decode="off"),
        media=MediaConfig(image_fetch_timeout=1.5, video_options={"backend": "pyav", "num_frames": 8}),
        queue=QueueConfig(visibility_timeout=7.0, poison_crashes=5),
        worker=WorkerConfig(preprocess_workers=2, worker_cpus=frozenset({0, 1}), pin_worker_cpus=False),
    )
    command = Supervisor("some/model", "redis://127.0.0.1:1/0", ["3"], configs).command("3")
    assert command[1:3] == ["-m", "vlmbatch.workers.process"]
    args = parse_args(command[3:])
    assert (args.model, args.broker, args.slot, args.dry_run) == ("some/model", "redis://127.0.0.1:1/0", "3", False)
    env = pinned_env("3", [4, 5])
    assert (env["CUDA_VISIBLE_DEVICES"], env["VLMBATCH_WORKER_CPUS"]) == ("3", "4,5")
    rebuilt = ProcessConfigs.from_args(args, env)
    assert rebuilt.engine == configs.engine and rebuilt.media == configs.media and rebuilt.queue == configs.queue
    assert rebuilt.worker == WorkerConfig(preprocess_workers=2, worker_cpus=frozenset({4, 5}), pin_worker_cpus=False)


def test_secrets_travel_in_the_environment_and_each_slot_gets_its_metrics_port() -> None:
    """Storage options (credentials) never reach a child's command line, which `ps` shows;
    GPU process i serves metrics on `--metrics-port` + i; every child knows its supervisor."""
    from vlmbatch.workers.process import ProcessConfigs, parse_args
    from vlmbatch.workers.supervisor import Supervisor, pinned_env

    secret = {"key": "AKIA-test", "secret": "very-secret", "endpoint_url": "http://minio:9000"}
    configs = ProcessConfigs(EngineConfig(), MediaConfig(), QueueConfig(),
                             WorkerConfig(storage_options=secret, metrics_port=9400))
    supervisor = Supervisor("m", "redis://127.0.0.1:1/0", ["0", "1"], configs)
    for slot, port in (("0", 9400), ("1", 9401)):
        command = supervisor.command(slot)
        assert "very-secret" not in " ".join(command)
        args = parse_args(command[3:])
        assert args.supervisor_pid == os.getpid()
        env = pinned_env(slot, None, configs.worker.storage_options)
        rebuilt = ProcessConfigs.from_args(args, env).worker
        assert (rebuilt.metrics_port, rebuilt.storage_options) == (port, secret)


def test_worker_flags_are_checked_once_and_never_written_to_the_environment() -> None:
    from vlmbatch.cli.commands import app

    runner = CliRunner()
    base = ["worker", "--model", "m", "--broker", "redis://127.0.0.1:1/0"]
    bad = runner.invoke(app, [*base, "--attention-backend", "nope"])
    assert bad.exit_code == 2 and "attention_backend='nope'" in bad.output
    assert "--attention-backend" in runner.invoke(app, ["worker", "--help"]).output
    before = dict(os.environ)
    # a repeated GPU stops the command after the configuration was built, before any process starts
    stopped = runner.invoke(app, [*base, "--gpu-image-decode", "on", "--attention-backend", "torch", "--gpus", "0,0"])
    assert stopped.exit_code == 2 and "lists a slot twice" in stopped.output
    assert dict(os.environ) == before
