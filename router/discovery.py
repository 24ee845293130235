"""Where the replicas are: --scheduler lists addresses (HOST:PORT) and DNS names
(dns:NAME:PORT, e.g. a Kubernetes headless Service, resolving to one address per
replica Pod). Names are resolved again every --resolve-interval-s, so replicas come
and go without restarting the router."""

import asyncio
import logging
import socket

log = logging.getLogger("flagstop.router")


def parse_targets(value: str) -> list[str]:
    """The comma-separated entries of --scheduler; ValueError naming a bad one."""
    targets = [t.strip() for t in value.split(",") if t.strip()]
    if not targets:
        raise ValueError("no address given")
    for target in targets:
        host, _, port = target.removeprefix("dns:").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{target!r} is not HOST:PORT or dns:NAME:PORT")
        try:
            host.encode("idna")  # what the resolver will ask for
        except UnicodeError as e:
            raise ValueError(f"{target!r}: not a valid host name ({e})") from None
    return targets


def has_names(targets: list[str]) -> bool:
    return any(t.startswith("dns:") for t in targets)


class Resolver:
    """The addresses of the targets. A name that fails to resolve keeps the addresses
    it had (a DNS hiccup must not drop every replica)."""

    def __init__(self) -> None:
        self.last: dict[str, set[str]] = {}

    async def addresses(self, targets: list[str]) -> set[str]:
        found: set[str] = set()
        for target in targets:
            if not target.startswith("dns:"):
                found.add(target)
                continue
            try:
                self.last[target] = await resolve(target)
            except (OSError, UnicodeError) as e:
                log.warning("cannot resolve %s: %s; keeping %s", target, e,
                            sorted(self.last.get(target, ())))  # fmt: skip
            found |= self.last.get(target, set())
        return found


async def resolve(target: str) -> set[str]:
    host, _, port = target.removeprefix("dns:").rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    return {_address(info[4][0], port) for info in infos}


def _address(ip: str, port: str) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
