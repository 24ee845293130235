"""An image reference as a request carries it (a data: URL, an http(s) URL, a
file:// path, or bytes) turned into its encoded bytes, within limits: a size cap, a
timeout, the schemes allowed. Every refusal is a RequestRejected that names the
image and what is wrong, which the fronts answer with a 400."""

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from flagstop.scheduler_svc.core.limits import RequestRejected


@dataclass(frozen=True, slots=True)
class FetchLimits:
    max_bytes: int  # an image's encoded bytes at most (--media-max-bytes)
    timeout_s: float  # an http(s) fetch's whole time (--media-fetch-timeout-s)
    allowed_local_path: Path | None  # file:// under this directory only (None: never)


class ImageFetcher:
    def __init__(self, limits: FetchLimits) -> None:
        self.limits = limits
        self.client: httpx.AsyncClient | None = None  # made on first use (its loop's)

    async def bytes_of(self, url: str, where: str) -> bytes:
        """where: the part's name in the refusal (e.g. messages[0].content[1])."""
        scheme = urlparse(url).scheme.lower()
        if scheme == "data":
            data = self._data_url(url, where)
        elif scheme in ("http", "https"):
            data = await self._http(url, where)
        elif scheme == "file":
            data = self._file(url, where)
        else:
            raise RequestRejected(f"{where}: an image URL is data:, http(s): or file:, "
                                  f"got {scheme or 'no'} scheme", where)  # fmt: skip
        self.check_size(len(data), where)
        return data

    def check_size(self, num_bytes: int, where: str) -> None:
        if num_bytes > self.limits.max_bytes:
            raise RequestRejected(f"{where}: the image is {num_bytes} bytes, more than "
                                  f"--media-max-bytes {self.limits.max_bytes}", where)  # fmt: skip
        if not num_bytes:
            raise RequestRejected(f"{where}: the image is empty", where)

    @staticmethod
    def _data_url(url: str, where: str) -> bytes:
        header, _, payload = url.partition(",")
        media_type = header[5:].split(";")[0].lower()
        if media_type and not media_type.startswith("image/"):
            raise RequestRejected(f"{where}: a data URL of {media_type!r}, not an image/* "
                                  "type", where)  # fmt: skip
        if not header.endswith(";base64"):
            return unquote(payload).encode("latin-1")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestRejected(f"{where}: the data URL's base64 does not decode",
                                  where) from None  # fmt: skip

    async def _http(self, url: str, where: str) -> bytes:
        if self.client is None:
            self.client = httpx.AsyncClient(follow_redirects=True, max_redirects=3)
        cap, timeout = self.limits.max_bytes, self.limits.timeout_s
        try:
            async with self.client.stream("GET", url, timeout=timeout) as response:
                if response.status_code != 200:
                    raise RequestRejected(f"{where}: fetching {url} gave HTTP "
                                          f"{response.status_code}", where)  # fmt: skip
                kind = response.headers.get("content-type", "image/").split(";")[0].lower()
                if not kind.startswith(("image/", "application/octet-stream")):
                    raise RequestRejected(f"{where}: {url} is {kind!r}, not an image", where)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > cap:
                        raise RequestRejected(f"{where}: {url} is more than --media-max-bytes "
                                              f"{cap}", where)  # fmt: skip
                return bytes(data)
        except httpx.TimeoutException:
            message = f"{where}: fetching {url} took more than --media-fetch-timeout-s {timeout}"
            raise RequestRejected(message, where) from None
        except httpx.HTTPError as e:
            raise RequestRejected(f"{where}: fetching {url} failed: {e}", where) from None

    def _file(self, url: str, where: str) -> bytes:
        root = self.limits.allowed_local_path
        if root is None:
            raise RequestRejected(f"{where}: file:// images are off; start the router with "
                                  "--allowed-local-media-path DIR", where)  # fmt: skip
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(root.resolve()):
            raise RequestRejected(f"{where}: {path} is outside --allowed-local-media-path",
                                  where)  # fmt: skip
        try:
            self.check_size(path.stat().st_size, where)
            return path.read_bytes()
        except OSError as e:
            raise RequestRejected(f"{where}: {path}: {e.strerror}", where) from None

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
