"""A small OCI distribution (registry v2) client: manifests and blobs, with auth.

Auth follows the registry's ``WWW-Authenticate`` challenge: ``Basic`` resends the
credentials, ``Bearer`` fetches a token from the realm (with Basic credentials when known)
for the repository's pull scope and caches it. Everything the registry sends is checked
against its digest before it is used; blobs are streamed to ``<dest>.part`` (hashing as they
arrive), resumed with ``Range`` when a ``.part`` is already there, and renamed into place
only when the sha256 matches.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from dsec.core.errors import (
    DsecError,
    ImageNotFound,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
)
from dsec.edge.images.credentials import RegistrySettings
from dsec.edge.images.reference import Reference

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
MAX_MANIFEST = 4 << 20
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')

Progress = Callable[[int], None]  # bytes received since the last call


@dataclass(frozen=True, slots=True)
class Manifest:
    """A fetched manifest or index: its bytes, digest and media type."""

    digest: str
    media_type: str
    body: bytes

    def json(self) -> dict[str, Any]:
        data = json.loads(self.body)
        if not isinstance(data, dict):
            raise InvalidArgument(f"manifest {self.digest} is not a JSON object")
        return data


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _check_digest(digest: str) -> str:
    if not re.match(r"^sha256:[0-9a-f]{64}$", digest):
        raise InvalidArgument(f"unsupported or malformed digest {digest!r} (only sha256)")
    return digest


class RegistryClient:
    """Talks to one registry for one repository (thread-safe: blobs download in parallel)."""

    def __init__(
        self,
        ref: Reference,
        settings: RegistrySettings,
        *,
        insecure: bool = False,
        timeout: float = 60.0,
        push: bool = False,
    ) -> None:
        self.ref = ref
        self.actions = "pull,push" if push else "pull"
        self.settings = settings
        plain = insecure or settings.insecure
        self.base = f"{'http' if plain else 'https'}://{ref.api_host}/v2"
        verify: Any = (
            ssl.create_default_context(cafile=settings.ca_file) if settings.ca_file else True
        )
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=10.0),
            verify=verify,
            follow_redirects=True,
            trust_env=False,
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=16),
        )
        self._auth_header: str | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- auth ------------------------------------------------------------------------

    def _authenticate(self, challenge: str) -> bool:
        """Answer a 401 challenge; False when there is nothing new to try."""
        scheme, _, params_text = challenge.partition(" ")
        params = dict(_CHALLENGE_PARAM.findall(params_text))
        creds = (self.settings.username, self.settings.password)
        if scheme.lower() == "basic":
            if not self.settings.has_credentials:
                return False
            header = "Basic " + _b64(f"{creds[0]}:{creds[1]}")
        elif scheme.lower() == "bearer" and params.get("realm"):
            query = {"scope": f"repository:{self.ref.repository}:{self.actions}"}
            if params.get("service"):
                query["service"] = params["service"]
            auth = creds if self.settings.has_credentials else None
            try:
                resp = self._http.get(params["realm"], params=query, auth=auth)
            except httpx.HTTPError as exc:
                raise Unavailable(f"token server {params['realm']}: {exc}") from None
            if resp.status_code in (401, 403):
                raise Unauthenticated(
                    f"registry {self.ref.registry} refused the credentials "
                    f"({resp.status_code} from its token server)"
                )
            if resp.status_code != 200:
                raise Unavailable(f"token server {params['realm']}: HTTP {resp.status_code}")
            try:
                body = resp.json()
                token = body.get("token") or body.get("access_token")
            except ValueError:
                token = None
            if not isinstance(token, str) or not token:
                raise Unavailable(f"token server {params['realm']} sent no token")
            header = f"Bearer {token}"
        else:
            return False
        with self._lock:
            if header == self._auth_header:
                return False
            self._auth_header = header
        return True

    @contextmanager
    def _request(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None = None,
        *,
        what: str,
        content: bytes | IO[bytes] | None = None,
    ) -> Iterator[httpx.Response]:
        """Send one request (re-sent once after an auth challenge) and yield the response."""
        for attempt in (0, 1):
            hdrs = dict(headers or {})
            if self._auth_header:
                hdrs["Authorization"] = self._auth_header
            try:
                req = self._http.build_request(method, url, headers=hdrs, content=content)
                resp = self._http.send(req, stream=True)
            except httpx.HTTPError as exc:
                raise Unavailable(f"registry {self.ref.registry}: {what}: {exc}") from None
            try:
                if resp.status_code == 401 and attempt == 0:
                    challenge = resp.headers.get("www-authenticate", "")
                    if self._authenticate(challenge):
                        continue
                if resp.status_code >= 400:
                    raise self._error(resp, what)
                yield resp
                return
            finally:
                resp.close()

    def _error(self, resp: httpx.Response, what: str) -> DsecError:
        try:
            resp.read()
            errors = resp.json().get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
        except (ValueError, AttributeError, httpx.HTTPError):
            detail = ""
        where = f"registry {self.ref.registry}: {what}"
        suffix = f" ({detail})" if detail else ""
        status = resp.status_code
        if status == 401:
            hint = "" if self.settings.has_credentials else "; log in with `dsec registry login`"
            return Unauthenticated(f"{where}: authentication required{suffix}{hint}")
        if status == 403:
            return PermissionDenied(f"{where}: access denied{suffix}")
        if status == 404:
            return ImageNotFound(f"{where}: not found{suffix}")
        if status == 429:
            return QuotaExceeded(f"{where}: rate limited by the registry (429){suffix}")
        return Unavailable(f"{where}: HTTP {status}{suffix}")

    # --- manifests -------------------------------------------------------------------

    def get_manifest(self, selector: str) -> Manifest:
        """Fetch a manifest or index by tag or digest, verifying its digest.

        Raises:
            ImageNotFound: no such tag or digest.
            InvalidArgument: the body does not match the digest, or is not a manifest.
        """
        accept = ", ".join((*INDEX_TYPES, *MANIFEST_TYPES))
        url = f"{self.base}/{self.ref.repository}/manifests/{selector}"
        with self._request("GET", url, {"Accept": accept}, what=f"manifest {selector}") as r:
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > MAX_MANIFEST:
                    raise InvalidArgument(f"manifest {selector} is larger than 4 MiB")
            header_digest = r.headers.get("docker-content-digest", "")
            media_type = r.headers.get("content-type", "").split(";")[0].strip()
        digest = sha256_digest(body)
        expected = selector if selector.startswith("sha256:") else header_digest
        if expected and expected != digest:
            raise InvalidArgument(
                f"registry {self.ref.registry}: manifest {selector} has digest {digest}, "
                f"expected {expected}"
            )
        try:
            parsed = json.loads(body)
        except ValueError:
            raise InvalidArgument(f"manifest {selector} is not JSON") from None
        if isinstance(parsed, dict) and parsed.get("mediaType"):
            media_type = str(parsed["mediaType"])
        if media_type not in (*INDEX_TYPES, *MANIFEST_TYPES):
            raise InvalidArgument(
                f"manifest {selector} has unsupported media type {media_type!r} "
                "(OCI or Docker v2 schema 2 images only)"
            )
        return Manifest(digest=digest, media_type=media_type, body=body)

    # --- blobs -----------------------------------------------------------------------

    def get_blob_bytes(self, digest: str, limit: int = MAX_MANIFEST) -> bytes:
        """A small blob (an image config) in memory, verified."""
        _check_digest(digest)
        url = f"{self.base}/{self.ref.repository}/blobs/{digest}"
        with self._request("GET", url, what=f"blob {digest}") as r:
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > limit:
                    raise InvalidArgument(f"blob {digest} is larger than {limit} bytes")
        if sha256_digest(body) != digest:
            raise InvalidArgument(f"registry {self.ref.registry}: blob {digest} does not match")
        return body

    def download_blob(
        self, digest: str, dest: Path, *, size: int = -1, progress: Progress | None = None
    ) -> None:
        """Stream a blob into ``dest`` (via ``dest.part``, resumed if present), verified.

        Raises:
            InvalidArgument: the content does not match ``digest`` (the part file is removed).
        """
        _check_digest(digest)
        part = dest.with_name(dest.name + ".part")
        h = hashlib.sha256()
        have = 0
        if part.exists():
            with part.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    have += len(chunk)
            if size >= 0 and have > size:
                part.unlink()
                h, have = hashlib.sha256(), 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        if have and size >= 0 and have == size:
            headers = {}
            done = True
        else:
            done = False
        if not done:
            url = f"{self.base}/{self.ref.repository}/blobs/{digest}"
            with self._request("GET", url, headers, what=f"blob {digest}") as r:
                if have and r.status_code != 206:  # the registry ignored Range: start over
                    h, have = hashlib.sha256(), 0
                mode = "ab" if have else "wb"
                with part.open(mode) as f:
                    if progress and have:
                        progress(have)
                    for chunk in r.iter_bytes(1 << 20):
                        f.write(chunk)
                        h.update(chunk)
                        if progress:
                            progress(len(chunk))
        got = "sha256:" + h.hexdigest()
        if got != digest:
            part.unlink(missing_ok=True)
            raise InvalidArgument(
                f"registry {self.ref.registry}: blob {digest} arrived with digest {got}; "
                "nothing was stored"
            )
        os.replace(part, dest)

    # --- push ------------------------------------------------------------------------

    def upload_blob(self, digest: str, data: bytes) -> None:
        """Upload one blob (monolithic POST + PUT) unless the registry has it."""
        if self.blob_exists(digest):
            return
        url = f"{self.base}/{self.ref.repository}/blobs/uploads/"
        with self._request("POST", url, what=f"upload of {digest}") as r:
            location = r.headers.get("location", "")
        if not location:
            raise Unavailable(f"registry {self.ref.registry} gave no upload location")
        put_url = httpx.URL(url).join(location)
        put_url = put_url.copy_merge_params({"digest": digest})
        headers = {"Content-Type": "application/octet-stream"}
        with self._request("PUT", str(put_url), headers, what=f"upload of {digest}", content=data):
            pass

    def upload_blob_file(self, digest: str, path: Path, *, mount_from: str = "") -> None:
        """Upload a stored blob unless the registry has it; mount it from ``mount_from``
        (another repository of the same registry) when possible."""
        if self.blob_exists(digest):
            return
        url = f"{self.base}/{self.ref.repository}/blobs/uploads/"
        if mount_from:
            mount_url = httpx.URL(url).copy_merge_params({"mount": digest, "from": mount_from})
            with self._request("POST", str(mount_url), what=f"mount of {digest}") as r:
                if r.status_code == 201:
                    return
                location = r.headers.get("location", "")  # not mounted: an upload started
        else:
            with self._request("POST", url, what=f"upload of {digest}") as r:
                location = r.headers.get("location", "")
        if not location:
            raise Unavailable(f"registry {self.ref.registry} gave no upload location")
        put_url = httpx.URL(url).join(location).copy_merge_params({"digest": digest})
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(path.stat().st_size),
        }
        with (
            path.open("rb") as f,
            self._request("PUT", str(put_url), headers, what=f"upload of {digest}", content=f),
        ):
            pass

    def put_manifest(self, tag: str, media_type: str, body: bytes) -> str:
        """Store a manifest (or index) under ``tag``; return its digest."""
        url = f"{self.base}/{self.ref.repository}/manifests/{tag}"
        with self._request(
            "PUT", url, {"Content-Type": media_type}, what=f"manifest {tag}", content=body
        ):
            pass
        return sha256_digest(body)

    def blob_exists(self, digest: str) -> bool:
        url = f"{self.base}/{self.ref.repository}/blobs/{_check_digest(digest)}"
        try:
            with self._request("HEAD", url, what=f"blob {digest}"):
                return True
        except NotFound:
            return False


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
