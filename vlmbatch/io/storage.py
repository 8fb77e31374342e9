"""Where datasets and job folders live: a local path or an object-storage URL.

`resolve(target, storage_options)` turns `s3://bucket/prefix` (AWS or any S3-compatible
store), any other fsspec URL (`gs://`, `az://`, `memory://`, ... wherever its filesystem
package is installed) or a local path into a `Location`. A local path stays a
`pathlib.Path`, so everything local behaves as it always did; a URL becomes an
`ObjectPath`, which has the few `Path` members job code uses (`/`, `name`, `parent`,
`exists()`, `read_bytes()`, `resolve()`, `str()`), so callers treat both alike.

Which library does what, and why:
- S3 reads go through pyarrow's `S3FileSystem`. pyarrow's Parquet reader drives it with
  exactly the byte ranges it needs (the footer, then the column chunks of the row groups
  asked for) and it keeps no read-ahead cache, so a footer read stays a few kilobytes and a
  JSONL window read (`read_at`) costs what it asks for.
- S3 writes go through fsspec's `s3fs`: pyarrow cannot send a conditional put
  (`If-None-Match: *`), which first-writer-wins commits need (`Storage.put_new`), and its
  output streams complete a multipart upload even when the writer failed half-way.
- Other protocols use their fsspec filesystem for writes and, wrapped for pyarrow
  (`PyFileSystem(FSSpecHandler(...))`), for reads, so readers see one interface.

S3 configuration: the endpoint, region and credentials come from the standard AWS
environment variables and config files, as botocore (the AWS SDK for Python) resolves them
once per storage; `storage_options` override them. pyarrow reads neither endpoints nor
regions from those files, so the resolved endpoint and region are handed to both libraries.
Credentials are handed over only when `storage_options` give them (or name a profile);
otherwise each library follows the standard credential chain itself, which keeps temporary
credentials (SSO, assumed roles, instance profiles) refreshed during long jobs.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union
from urllib.parse import urlparse

import pyarrow.fs as pafs

from vlmbatch.config import ConfigError
from vlmbatch.errors import JobError

# `--storage-options` for s3:// URLs, named as s3fs (and pandas, dask, Hugging Face
# datasets) name them.
S3_OPTIONS = {
    "endpoint_url": "URL of an S3-compatible store (default: the AWS configuration, else AWS itself)",
    "region": "region name (default: the AWS configuration, else the bucket's own region)",
    "key": "access key id",
    "secret": "secret access key",
    "token": "session token",
    "profile": "profile of the AWS config files",
    "anon": "true: unsigned requests (public buckets)",
}
LOCAL_PROTOCOLS = ("file", "local")
AWS_HOST_SUFFIX = ".amazonaws.com"
# Uploads larger than two chunks go as multipart uploads of this chunk size. A result part
# below 4 GiB is therefore one conditional PUT (S3 takes up to 5 GiB in one): racing writers
# of one part are decided by the store atomically. Racing conditional *multipart* completions
# were seen to both succeed on SeaweedFS 4.48 (1 race in 3 with three writers), so they are
# kept for parts too large for one PUT.
UPLOAD_CHUNK_BYTES = 2 * 1024**3
# Tries after a 409 (a concurrent conditional write of the same key), with back-off.
CONFLICT_RETRIES = 4
# pyarrow's own default would let an unreachable endpoint stall a submit for minutes.
CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 60.0


def protocol_of(target: "str | os.PathLike[str] | ObjectPath") -> str | None:
    """`s3` for `s3://bucket/key`; None for a local path (or a `file://` URL)."""
    if isinstance(target, ObjectPath):
        return target.storage.protocol
    text = os.fspath(target)
    if "://" not in text:
        return None
    protocol = text.split("://", 1)[0].lower()
    return None if protocol in LOCAL_PROTOCOLS else protocol


def is_remote(target: "str | os.PathLike[str] | ObjectPath") -> bool:
    return protocol_of(target) is not None


@dataclass(eq=False)
class Storage:
    """One filesystem (a protocol with its options): pyarrow's view for reading, fsspec's
    for writing. Instances are shared per (protocol, bucket, options), see `_storage`."""

    protocol: str
    options: dict[str, Any]
    arrow: pafs.FileSystem
    _fsspec_factory: Any = field(repr=False)

    @functools.cached_property
    def fsspec(self) -> Any:
        return self._fsspec_factory()

    def url(self, path: str) -> str:
        return f"{self.protocol}://{path}"

    def put_new(self, local_file: Path, path: str) -> bool:
        """Upload `local_file` to `path` unless an object is there already; True if this call
        created it. On S3 this is one conditional put (`If-None-Match: *`, or a multipart
        upload completed with it): the store decides, so of two racing writers exactly one
        wins and the object appears whole or not at all. Other fsspec filesystems use their
        own `mode="create"`: atomic where they implement it (gcsfs, by generation match),
        else a look before the write (the last of two racing writers wins, whole).

        AWS answers 409 (ConditionalRequestConflict) when another conditional write of the
        key is in flight: the put is tried again, and then wins or meets the winner's 412."""
        attempt = 0
        while True:
            try:
                self.fsspec.put_file(str(local_file), path, mode="create", **self._chunking())
                return True
            except FileExistsError:
                return False
            except OSError as exc:
                status = _s3_status(exc)
                if status == 412:
                    return False
                if status != 409 or attempt == CONFLICT_RETRIES:
                    raise
            time.sleep(0.1 * 2**attempt)
            attempt += 1

    def put(self, local_file: Path, path: str) -> None:
        """Upload `local_file` to `path`, replacing what is there (an object appears whole)."""
        self.fsspec.put_file(str(local_file), path, **self._chunking())

    def _chunking(self) -> dict[str, Any]:
        return {"chunksize": UPLOAD_CHUNK_BYTES} if self.protocol == "s3" else {}


def _s3_status(exc: BaseException) -> int | None:
    """The HTTP status behind an s3fs error. s3fs turns AWS's 412 into `FileExistsError` (AWS
    names the `If-None-Match` condition); stores that omit the name (SeaweedFS), and other
    codes, arrive as an `OSError` caused by botocore's `ClientError`."""
    response = getattr(exc.__cause__, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    if code == "PreconditionFailed":
        return 412
    if code == "ConditionalRequestConflict":
        return 409
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")


@dataclass(frozen=True)
class ObjectPath:
    """A key or a key prefix ("folder") in object storage: `s3://bucket/prefix/name`."""

    storage: Storage
    path: str  # bucket/key, without a protocol or a trailing slash

    def __str__(self) -> str:
        return self.storage.url(self.path)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(self.storage, f"{self.path}/{str(name).strip('/')}")

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]

    @property
    def parent(self) -> "ObjectPath":
        head, _, _ = self.path.rpartition("/")
        return ObjectPath(self.storage, head or self.path)

    def resolve(self) -> "ObjectPath":
        """Already absolute (so `location.resolve()` works on both kinds)."""
        return self

    def info(self) -> pafs.FileInfo:
        return self.storage.arrow.get_file_info(self.path)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def read_bytes(self) -> bytes:
        """The whole object (small ones: manifests). A missing key raises FileNotFoundError."""
        with self.storage.arrow.open_input_stream(self.path) as stream:
            return stream.read()

    def open_input(self) -> Any:
        """A random-access file over the object: each read is one ranged GET."""
        return self.storage.arrow.open_input_file(self.path)


Location = Union[Path, ObjectPath]


@dataclass(frozen=True)
class ObjectMedia:
    """Reads media that rows name by object-storage URL (`s3://bucket/key.jpg`) under the
    media rules: only the `buckets` listed (None: any), the size cap checked from the
    object's metadata before a byte is read, pyarrow's connect and request timeouts.
    Picklable (it travels to the preprocessing workers); each process builds its own client.
    Errors are `RowError`s: the row fails, the job goes on."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    buckets: tuple[str, ...] | None = None

    def __call__(self, url: str, max_bytes: int) -> bytes:
        from vlmbatch.errors import ErrorType, RowError

        bucket = url.split("://", 1)[1].split("/", 1)[0]
        if self.buckets is not None and bucket not in self.buckets:
            raise RowError(ErrorType.MEDIA_FORBIDDEN, f"bucket {bucket!r} is not in the allowed media buckets")
        try:
            location = resolve(url, self.storage_options)
            if not isinstance(location, ObjectPath):
                raise RowError(ErrorType.MEDIA_FORBIDDEN, f"{url} is not an object-storage URL")
            info = location.info()
            if info.type != pafs.FileType.File:
                raise RowError(ErrorType.MEDIA_NOT_FOUND, f"no such object: {url}")
            if info.size is not None and info.size > max_bytes:
                raise RowError(ErrorType.MEDIA_TOO_LARGE, f"{url} is {info.size:,} bytes, over the {max_bytes:,}-byte cap")
            return location.read_bytes()
        except (OSError, JobError) as exc:
            raise RowError(ErrorType.MEDIA_FETCH, f"cannot read {url}: {exc}") from exc


def resolve(target: str | os.PathLike[str] | ObjectPath, storage_options: dict[str, Any] | None = None) -> Location:
    """A local path or an object-storage URL as a `Location` (see the module docstring)."""
    if isinstance(target, (Path, ObjectPath)):
        return target
    text = os.fspath(target)
    protocol = protocol_of(text)
    if protocol is None:
        return Path(text.split("://", 1)[1] if "://" in text else text)
    path = text.split("://", 1)[1].strip("/")
    if not path:
        raise JobError(f"{text}: names no bucket or container")
    bucket = path.split("/", 1)[0] if protocol in ("s3", "s3a") else ""
    options = json.dumps(storage_options or {}, sort_keys=True, default=str)
    return ObjectPath(_storage(protocol, bucket, options), path)


def open_input(location: Location) -> Any:
    """A seekable binary file for reading: the local file, or ranged reads of the object."""
    return location.open_input() if isinstance(location, ObjectPath) else open(location, "rb")


def parquet_source(location: Location) -> Any:
    """What `pyarrow.parquet` should open: a local path as such (memory-mapped reads and all,
    as before), an object as a random-access file (footer and column chunks by range)."""
    return location.open_input() if isinstance(location, ObjectPath) else location


def list_names(folder: Location) -> set[str]:
    """Names of the files directly in `folder` (nothing if it does not exist): one listing
    instead of one existence check per file."""
    if isinstance(folder, Path):
        return {entry.name for entry in folder.iterdir() if entry.is_file()} if folder.is_dir() else set()
    selector = pafs.FileSelector(folder.path, allow_not_found=True)
    return {info.base_name for info in folder.storage.arrow.get_file_info(selector) if info.type == pafs.FileType.File}


@functools.lru_cache(maxsize=64)
def _storage(protocol: str, bucket: str, options_json: str) -> Storage:
    options = json.loads(options_json)
    if protocol in ("s3", "s3a"):
        return _s3_storage(bucket, options)
    return _fsspec_storage(protocol, options)


def _fsspec_storage(protocol: str, options: dict[str, Any]) -> Storage:
    try:
        import fsspec

        filesystem = fsspec.filesystem(protocol, **options)
    except (ImportError, ValueError) as exc:
        raise JobError(f"{protocol}:// URLs need their fsspec filesystem package ({exc})") from exc
    except TypeError as exc:
        raise ConfigError(f"--storage-options for {protocol}://: {exc}") from exc
    arrow = pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    return Storage(protocol, options, arrow, lambda: filesystem)


@dataclass(frozen=True)
class S3Settings:
    """S3 settings after the AWS configuration and `storage_options` are merged."""

    endpoint_url: str | None
    region: str | None
    key: str | None = None
    secret: str | None = None
    token: str | None = None
    profile: str | None = None
    anon: bool = False

    @classmethod
    def resolve(cls, options: dict[str, Any]) -> "S3Settings":
        unknown = sorted(set(options) - set(S3_OPTIONS))
        if unknown:
            known = ", ".join(f"{name} ({meaning})" for name, meaning in S3_OPTIONS.items())
            raise ConfigError(f"--storage-options: unknown option(s) {unknown} for s3://; known: {known}")
        try:
            import botocore.session
        except ImportError as exc:
            raise JobError("s3:// URLs need s3fs (and botocore): pip install 'vlmbatch[s3]'") from exc
        profile = options.get("profile")
        try:
            session = botocore.session.Session(profile=profile)
            region = options.get("region") or session.get_config_variable("region")
            endpoint = options.get("endpoint_url") or _configured_endpoint(session, region)
        except Exception as exc:  # noqa: BLE001 - botocore's config errors have many types
            raise ConfigError(f"AWS configuration: {exc}") from exc
        key, secret, token = options.get("key"), options.get("secret"), options.get("token")
        if profile and not key:  # pyarrow cannot read a named profile: hand its credentials over
            credentials = session.get_credentials()
            if credentials is not None:
                frozen = credentials.get_frozen_credentials()
                key, secret, token = frozen.access_key, frozen.secret_key, frozen.token
        return cls(endpoint, region, key, secret, token, profile, _truthy(options.get("anon", False)))

    def arrow_kwargs(self, bucket: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S}
        if self.endpoint_url:
            parsed = urlparse(self.endpoint_url)
            kwargs.update(endpoint_override=parsed.netloc + parsed.path.rstrip("/"), scheme=parsed.scheme or "https")
        region = self.region
        if region is None and not self.endpoint_url and bucket:
            region = _bucket_region(bucket)
        if region:
            kwargs["region"] = region
        if self.anon:
            kwargs["anonymous"] = True
        elif self.key:
            kwargs.update(access_key=self.key, secret_key=self.secret, session_token=self.token)
        return kwargs

    def s3fs_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"anon": self.anon}
        if self.endpoint_url:
            # Path-style addressing, as pyarrow uses with an endpoint: a custom store's DNS
            # rarely resolves bucket.host names.
            kwargs.update(endpoint_url=self.endpoint_url, config_kwargs={"s3": {"addressing_style": "path"}})
        if self.region:
            kwargs["client_kwargs"] = {"region_name": self.region}
        if self.key:
            kwargs.update(key=self.key, secret=self.secret, token=self.token)
        elif self.profile:
            kwargs["profile"] = self.profile
        return kwargs


def _configured_endpoint(session: Any, region: str | None) -> str | None:
    """The S3 endpoint the AWS configuration names (`AWS_ENDPOINT_URL[_S3]`, `endpoint_url` in
    the config file), or None when it names none and AWS's own endpoints apply. A client is
    built with placeholder credentials: resolving the endpoint needs no real ones, and
    looking for them could probe the instance metadata service."""
    client = session.create_client(
        "s3", region_name=region or "us-east-1", aws_access_key_id="unused", aws_secret_access_key="unused"
    )
    host = urlparse(client.meta.endpoint_url).hostname or ""
    return None if host == "s3.amazonaws.com" or host.endswith(AWS_HOST_SUFFIX) else client.meta.endpoint_url


def _bucket_region(bucket: str) -> str | None:
    """AWS's region of `bucket` (one HEAD request), so a bucket outside the default region works."""
    try:
        return pafs.resolve_s3_region(bucket)
    except OSError:
        return None  # unknown (offline, no access): the first real request reports the problem


def _truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


def _s3_storage(bucket: str, options: dict[str, Any]) -> Storage:
    settings = S3Settings.resolve(options)
    arrow = pafs.S3FileSystem(**settings.arrow_kwargs(bucket))

    def make_s3fs() -> Any:
        try:
            import s3fs
        except ImportError as exc:
            raise JobError("writing to s3:// needs s3fs: pip install 'vlmbatch[s3]'") from exc
        return s3fs.S3FileSystem(**settings.s3fs_kwargs())

    return Storage("s3", options, arrow, make_s3fs)
