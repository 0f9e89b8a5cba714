"""Failure domains: the sets of nodes one fault takes at once (a leaf switch, a rack, a PDU).

A node is the smallest domain: its ranks die together and its local storage with them. Where
the scheduler or the site knows more, several nodes share a domain, and redundancy placed by
node alone can put a partner copy, or more erasure-group members than the parity, under the
same switch (cluster/topology.py places across domains once they are known).

`cluster.failure_domains` says where a node's domain comes from:

- "auto" (default): the scheduler's topology where it gives one (Slurm with
  TopologyPlugin=topology/tree hands every task SLURM_TOPOLOGY_ADDR, e.g. "top.s2.n3": the node
  n3 under leaf switch s2), else every node its own domain;
- "nodes": every node its own domain (placement by node only);
- "PATTERN=DOMAIN,...": the site's map, host name patterns (shell style: n[1-4]*, rack7-*)
  to domain names, the first that matches wins;
- a path: a file of such lines "PATTERN DOMAIN" (or PATTERN=DOMAIN), # starts a comment.

A host no pattern matches is a domain of its own. Simulated nodes on one host take
`cluster.simulated_domains` instead: N domains of consecutive simulated nodes.

Pure functions: the host name and environment are arguments, so every rule is tested
without processes.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from hpcckpt.errors import ConfigError

AUTO, NODES = "auto", "nodes"


@dataclass(frozen=True)
class DomainRules:
    """How a node finds its failure domain: `site` pairs (pattern, domain) in order; `auto`:
    the scheduler's topology first."""

    auto: bool
    site: tuple[tuple[str, str], ...] = ()
    origin: str = ""

    @property
    def known(self) -> bool:
        return self.auto or bool(self.site)


def parse_domain_rules(setting: str, where: str = "cluster.failure_domains") -> DomainRules:
    """cluster.failure_domains as rules; a clear ConfigError for a map or file that says nothing."""
    text = setting.strip()
    if text in ("", AUTO):
        return DomainRules(auto=True, origin="the scheduler's topology")
    if text == NODES:
        return DomainRules(auto=False, origin="nodes")
    if "=" in text and "\n" not in text:
        entries, origin = text.split(","), "the map in cluster.failure_domains"
    else:
        path = Path(os.path.expanduser(text))
        try:
            entries = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"{where} = {setting!r}: not 'auto', 'nodes' or PATTERN=DOMAIN pairs, and the file "
                              f"cannot be read ({exc.strerror or exc}); give a readable file of 'PATTERN DOMAIN' "
                              "lines") from None
        origin = f"the map in {path}"
    site = []
    for number, entry in enumerate(entries, 1):
        entry = entry.split("#", 1)[0].strip()
        if not entry:
            continue
        parts = entry.split("=", 1) if "=" in entry else entry.split()
        parts = [p.strip() for p in parts]
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"{where}: entry {number} ({entry!r}) of {origin} is not 'PATTERN DOMAIN' or "
                              "PATTERN=DOMAIN; e.g. 'n[1-4]* switch1'")
        site.append((parts[0], parts[1]))
    if not site:
        raise ConfigError(f"{where}: {origin} maps no host to a domain; add 'PATTERN DOMAIN' lines or use 'auto'")
    return DomainRules(auto=False, site=tuple(site), origin=origin)


def domain_of_host(host: str, rules: DomainRules, environ: Mapping[str, str]) -> str:
    """The failure domain of the node `host` (with the environment of its first rank): the
    site's map, else the scheduler's topology, else the host itself."""
    for pattern, domain in rules.site:
        if fnmatch.fnmatchcase(host, pattern):
            return domain
    if rules.auto:
        scheduler = scheduler_domain(environ)
        if scheduler:
            return scheduler
    return host


def scheduler_domain(environ: Mapping[str, str]) -> str:
    """The switch above this task's node in Slurm's tree topology ("top.s2.n3" -> "top.s2";
    PBS's vnode and rack resources reach a job through a site map instead); "" where none."""
    address = environ.get("SLURM_TOPOLOGY_ADDR", "")
    pattern = environ.get("SLURM_TOPOLOGY_ADDR_PATTERN", "")
    parts = address.split(".")
    if len(parts) < 2:
        return ""
    kinds = pattern.split(".")
    if len(kinds) == len(parts) and kinds[-1] != "node":
        return ""  # not a tree ending in this node: no switch above it that we can name
    return ".".join(parts[:-1])


def simulated_domain_of_node(nodes: int, domains: int) -> tuple[int, ...]:
    """Simulated nodes in `domains` blocks of consecutive nodes (the first nodes % domains get
    one more), as simulated nodes take blocks of ranks."""
    if domains < 1 or domains > nodes:
        raise ConfigError(f"cluster.simulated_domains = {domains} must be between 1 and the {nodes} simulated "
                          "node(s); use 0 for a domain per node")
    base, extra = divmod(nodes, domains)
    return tuple(d for d in range(domains) for _ in range(base + (1 if d < extra else 0)))


def number_domains(names: Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Per node (in node order) its domain's number, numbered in order of first node, and the
    domain names in that order."""
    numbering: dict[str, int] = {}
    ids = tuple(numbering.setdefault(name, len(numbering)) for name in names)
    return ids, tuple(numbering)
