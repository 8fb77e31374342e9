"""The storage layer: URLs and paths to locations, S3 settings from the AWS configuration
and `--storage-options`, against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from s3_harness import S3Endpoint

from vlmbatch.config import ConfigError
from vlmbatch.io import storage
from vlmbatch.io.storage import ObjectPath, is_remote, list_names, resolve


@pytest.fixture(autouse=True)
def fresh_settings():
    """Settings are resolved once per storage: forget them around each test that changes the environment."""
    storage._storage.cache_clear()
    yield
    storage._storage.cache_clear()


@pytest.fixture
def clean_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No AWS configuration from the machine: empty config files, no AWS_* variables."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


def a_prefix(s3_server: S3Endpoint) -> str:
    return f"s3://{s3_server.bucket}/storage-{uuid.uuid4().hex[:8]}"


def test_local_paths_stay_paths() -> None:
    assert resolve("data/rows.jsonl") == Path("data/rows.jsonl")
    assert resolve("file:///tmp/rows.jsonl") == Path("/tmp/rows.jsonl")
    assert not is_remote("/tmp/x") and is_remote("s3://bucket/x") and is_remote("gs://bucket/x")


def test_object_paths_behave_like_paths(s3_server: S3Endpoint, tmp_path: Path) -> None:
    root = resolve(a_prefix(s3_server), s3_server.storage_options())
    assert isinstance(root, ObjectPath) and str(root).startswith("s3://")
    part = root / "results" / "part-00000-of-00001.parquet"
    assert part.name == "part-00000-of-00001.parquet" and part.parent == root / "results"
    assert not part.exists() and list_names(root / "results") == set()
    local = tmp_path / "x"
    local.write_bytes(b"payload")
    root.storage.put(local, part.path)
    assert part.exists() and part.read_bytes() == b"payload" and (root / "results").exists()
    assert list_names(root / "results") == {"part-00000-of-00001.parquet"}
    with pytest.raises(FileNotFoundError):
        (root / "missing").read_bytes()


def test_settings_from_the_standard_aws_environment(s3_server: S3Endpoint, clean_aws_env: Path,
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    prefix = resolve(a_prefix(s3_server))  # no storage options at all
    (tmp_path / "x").write_bytes(b"from env")
    prefix.storage.put(tmp_path / "x", (prefix / "x").path)
    assert (prefix / "x").read_bytes() == b"from env"


@pytest.mark.parametrize("profile", ["default", "store"])
def test_settings_from_the_aws_config_files(profile: str, s3_server: S3Endpoint, clean_aws_env: Path, tmp_path: Path) -> None:
    section = "default" if profile == "default" else f"profile {profile}"
    (clean_aws_env / "aws-config").write_text(f"[{section}]\nendpoint_url = {s3_server.url}\nregion = {s3_server.region}\n")
    (clean_aws_env / "aws-credentials").write_text(
        f"[{profile}]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n"
    )
    prefix = resolve(a_prefix(s3_server), {} if profile == "default" else {"profile": profile})
    (tmp_path / "x").write_bytes(b"from files")
    prefix.storage.put(tmp_path / "x", (prefix / "x").path)
    assert (prefix / "x").read_bytes() == b"from files"  # pyarrow read it: it saw the same settings


def test_storage_options_override_the_environment(s3_server: S3Endpoint, clean_aws_env: Path,
                                                  monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    prefix = resolve(a_prefix(s3_server), s3_server.storage_options())
    (tmp_path / "x").write_bytes(b"options win")
    prefix.storage.put(tmp_path / "x", (prefix / "x").path)
    assert (prefix / "x").read_bytes() == b"options win"


def test_unknown_storage_options_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="endpoint"):
        resolve("s3://bucket/x", {"endpoint": "http://example"})  # endpoint_url is the name


def test_other_fsspec_protocols_work_through_fsspec(tmp_path: Path) -> None:
    target = resolve(f"memory://vlmbatch-{uuid.uuid4().hex[:8]}/x.bin")
    assert isinstance(target, ObjectPath) and not target.exists()
    (tmp_path / "x").write_bytes(b"in memory")
    assert target.storage.put_new(tmp_path / "x", target.path)
    assert target.read_bytes() == b"in memory" and target.open_input().read() == b"in memory"
    assert not target.storage.put_new(tmp_path / "x", target.path)  # fsspec's create mode refuses an existing file


def test_object_media_reads_under_the_media_rules(s3_server: S3Endpoint, tmp_path: Path) -> None:
    """`s3://` media of a row: the bucket allow-list, missing objects and the size cap (from
    the object's metadata) are row errors; an allowed object's bytes come back whole."""
    from vlmbatch.errors import RowError
    from vlmbatch.io.storage import ObjectMedia

    key = f"media-{uuid.uuid4().hex[:8]}/a.bin"
    with s3_server.arrow_fs().open_output_stream(f"{s3_server.bucket}/{key}") as out:
        out.write(b"x" * 1000)
    url = f"s3://{s3_server.bucket}/{key}"
    options = s3_server.storage_options()
    assert ObjectMedia(options)(url, 10_000) == b"x" * 1000
    assert ObjectMedia(options, (s3_server.bucket,))(url, 10_000) == b"x" * 1000
    for reader, target, cap, error_type in [
        (ObjectMedia(options, ("another-bucket",)), url, 10_000, "media_forbidden"),
        (ObjectMedia(options), url + ".missing", 10_000, "media_not_found"),
        (ObjectMedia(options), url, 999, "media_too_large"),
    ]:
        with pytest.raises(RowError) as refused:
            reader(target, cap)
        assert refused.value.error_type == error_type, refused.value.message
