"""How object storage is reached: an s3fs file system whose every request has a connect and a read timeout and
a bounded number of tries, and the reasons users read when a request fails.

Credentials and region come the standard AWS way (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an
instance role); another S3-compatible service (MinIO, Cloudflare R2, Backblaze B2) is named by
AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from sdxl_trainer.cache.errors import StorageError

# How long object storage may keep a request waiting. s3fs's own settings wait 15 s per try but try a read 125
# times (botocore's 5 tries inside s3fs's 5, which a read nests twice: around the request and around reading
# its body), so a stalled endpoint (one that takes the connection and never answers) held a read for over
# 30 minutes. With these a stalled read fails after S3FS_TRIES**2 * REQUEST_ATTEMPTS = 12 tries of READ_TIMEOUT_S
# (3 minutes, plus at most 12 s of backoff), a request without a body (size, listing) after 6.
CONNECT_TIMEOUT_S = 10.0  # to open a connection: milliseconds where the endpoint is reachable; a refused one fails at once
READ_TIMEOUT_S = 15.0  # the longest silence within a response (before its first byte or between two): s3fs's default
READ_TIMEOUT_VARIABLE = "SDXL_S3_READ_TIMEOUT_S"  # overrides READ_TIMEOUT_S (seconds): longer for a slow service, short in tests
REQUEST_ATTEMPTS = 3  # botocore's tries of one request, in its "standard" mode: backoff, and retries on throttling and 5xx answers too
S3FS_TRIES = 2  # s3fs's own tries around botocore's; the outer one of a read also retries a connection dropped mid-body


def storage_error_reason(error: BaseException) -> str:
    """What to check, for the errors object storage gives."""
    name = type(error).__name__
    if name == "NoCredentialsError":
        return (
            "no credentials found. Set them the standard AWS way: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and "
            "AWS_ENDPOINT_URL_S3 for a service other than AWS (MinIO, R2, B2)"
        )
    if isinstance(error, PermissionError) or name in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return f"access denied ({error}): check the credentials and that they may read and write this bucket"
    if isinstance(error, FileExistsError):
        return "it exists already"
    if name in ("ReadTimeoutError", "ConnectTimeoutError"):
        url = urlsplit(getattr(error, "kwargs", {}).get("endpoint_url", ""))
        endpoint = f"{url.scheme}://{url.netloc}" if url.netloc else "the endpoint"
        if name == "ConnectTimeoutError":
            return f"could not connect to {endpoint} within {CONNECT_TIMEOUT_S:g} s (after retries): check the network and AWS_ENDPOINT_URL_S3, then re-run"
        return (
            f"no answer from {endpoint} within {read_timeout_s():g} s (after retries): it takes connections but does not respond, as a stalled "
            "server or proxy does; check it and AWS_ENDPOINT_URL_S3, then re-run"
        )
    return f"{name}: {error} (after retries; check the network and AWS_ENDPOINT_URL_S3, then re-run)"


def condition_failed(error: BaseException | None) -> bool:
    """Whether a conditional write was refused because another writer came first: 412 Precondition Failed (s3fs
    makes it a FileExistsError for If-None-Match) or, while two conditional writes race, 409 ConditionalRequestConflict."""
    if isinstance(error, FileExistsError):
        return True
    response = getattr(error, "response", None) or getattr(getattr(error, "__cause__", None), "response", None) or {}
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict")


def read_timeout_s() -> float:
    """READ_TIMEOUT_S, or the value of the environment variable READ_TIMEOUT_VARIABLE."""
    value = os.environ.get(READ_TIMEOUT_VARIABLE, "")
    if not value:
        return READ_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise StorageError(f"{READ_TIMEOUT_VARIABLE}={value!r}: give the object storage read timeout in seconds (> 0), or unset it for {READ_TIMEOUT_S:g}")
    return seconds


def bounded_s3_file_system():
    """An s3fs file system whose requests all end: CONNECT_TIMEOUT_S, read_timeout_s(), REQUEST_ATTEMPTS tries
    each, inside S3FS_TRIES of s3fs's own. No listings cache: other workers add objects while this one runs."""
    import s3fs  # only runs that use object storage pay for importing it

    class BoundedS3FileSystem(s3fs.S3FileSystem):
        retries = S3FS_TRIES  # s3fs takes its own tries from this class attribute only

    return BoundedS3FileSystem(
        use_listings_cache=False,
        skip_instance_cache=True,
        config_kwargs={
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": read_timeout_s(),
            "retries": {"total_max_attempts": REQUEST_ATTEMPTS, "mode": "standard"},
        },
    )
