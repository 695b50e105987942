"""Sans-I/O calls for images: pull and load (NDJSON progress stream), save, list, remove,
gc."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsec.core.errors import InvalidArgument
from dsec.sdk.models import JSON
from dsec.sdk.ndjson import NdjsonReader
from dsec.sdk.wire import Call, Request, json_body, json_request

PULL_TIMEOUT_S = 3600.0

PullProgress = Callable[[dict[str, Any]], None]


def pull_request(
    reference: str,
    *,
    platform: str = "",
    insecure: bool = False,
    username: str = "",
    password: str = "",
    edge_id: str = "",
) -> Request:
    """``POST /v1/images/pull`` answered as an NDJSON stream of progress lines."""
    if not reference:
        raise InvalidArgument("an image reference is required")
    body: dict[str, Any] = {"reference": reference, "stream": True}
    optional = {
        "platform": platform,
        "username": username,
        "password": password,
        "edge_id": edge_id,
    }
    body.update({k: v for k, v in optional.items() if v})
    if insecure:
        body["insecure"] = True
    return Request(
        "POST",
        "/v1/images/pull",
        (),
        json_body(body),
        (("Content-Type", "application/json"),),
        PULL_TIMEOUT_S,
    )


class PullReader(NdjsonReader[list[JSON]]):
    """Feeds NDJSON bytes in; reports progress lines; ends with the pulled images."""

    what = "pull"

    def __init__(self, progress: PullProgress | None) -> None:
        super().__init__()
        self.progress = progress

    def on_object(self, obj: JSON) -> None:
        if "images" in obj:
            self.value = list(obj["images"])
        elif "progress" in obj and self.progress is not None:
            self.progress({"edge_id": obj.get("edge_id", ""), **obj["progress"]})


def save_request(name: str, *, edge_id: str = "") -> Request:
    """``GET /v1/images/save``: the image as an OCI image-layout tar."""
    if not name:
        raise InvalidArgument("an image name is required")
    params = (("name", name),) + ((("edge_id", edge_id),) if edge_id else ())
    return Request("GET", "/v1/images/save", params, None, (), PULL_TIMEOUT_S)


def load_request(*, name: str = "", edge_id: str = "", kind: str = "") -> Request:
    """``POST /v1/images/load`` (the tar, or with ``kind="vm"`` a disk image, goes as
    streamed content); NDJSON answer."""
    if kind == "vm" and not name:
        raise InvalidArgument("a VM image import needs a name")
    pairs = (("name", name), ("edge_id", edge_id), ("kind", kind))
    params = tuple((k, v) for k, v in pairs if v)
    ctype = "application/octet-stream" if kind else "application/x-tar"
    return Request("POST", "/v1/images/load", params, None, (("Content-Type", ctype),),
                   PULL_TIMEOUT_S)  # fmt: skip


def upload_progress(progress: PullProgress | None, total: int) -> Callable[[int], None]:
    """Reports of the bytes of a disk image sent so far (``status`` "uploading")."""

    def sent(done: int) -> None:
        if progress is not None:
            progress({"edge_id": "", "digest": "upload", "status": "uploading",
                      "done": done, "total": total})  # fmt: skip

    return sent


def one_image(images: list[JSON]) -> JSON:
    if len(images) != 1:
        raise InvalidArgument(f"the edge answered {len(images)} images for one import")
    return images[0]


def _images(obj: JSON) -> list[JSON]:
    items = obj.get("images")
    return list(items) if isinstance(items, list) else []


def list_images() -> Call[list[JSON]]:
    return Call(json_request("GET", "/v1/images"), _images)


def remove_image(name: str) -> Call[JSON]:
    if not name:
        raise InvalidArgument("an image name is required")
    return Call(json_request("DELETE", "/v1/images", params=(("name", name),)), dict)


def gc_images() -> Call[JSON]:
    return Call(json_request("POST", "/v1/images/gc", {}, timeout=600), dict)


def pack_sandbox(
    sandbox_id: str,
    name: str,
    *,
    push: bool = False,
    insecure: bool = False,
    username: str = "",
    password: str = "",
) -> Call[JSON]:
    if not name:
        raise InvalidArgument("a name for the packed image is required")
    body: dict[str, Any] = {"name": name}
    if push:
        body.update(push=True, insecure=insecure)
        if username:
            body.update(username=username, password=password)
    return Call(
        json_request("POST", f"/v1/sandboxes/{sandbox_id}/pack", body, timeout=PULL_TIMEOUT_S),
        dict,
    )
