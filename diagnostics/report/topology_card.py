"""The start-up topology card of a run without NCCL logs (CPU, gloo): where each rank runs, where the rendezvous
store lives (the process a dead rank can take with it), and which groups of each mesh dim cross hosts."""

from __future__ import annotations


def topology_markdown(backend: str, store_address: str, store_host: int | None, hosts: dict[int, tuple[str, int]],
                      roles: dict[str, list[list[int]]]) -> str:
    """``hosts``: rank -> (hostname, pid); ``roles``: the Layout's mesh roles (role -> groups of global ranks)."""
    holder = f"rank {store_host}'s process" if store_host is not None else "the launcher's agent (torchrun)"
    lines = ["**Topology**", "", "| fact | value |", "|---|---|", f"| backend | {backend} |",
             f"| rendezvous store | {store_address}, hosted by {holder} |",
             f"| ranks / hosts | {len(hosts)} / {len({h for h, _ in hosts.values()})} |", ""]
    lines += ["| rank | host | pid |", "|---|---|---|"]
    lines += [f"| {rank} | {host} | {pid} |" for rank, (host, pid) in sorted(hosts.items())]
    lines += ["", "| dim | groups | groups across hosts |", "|---|---|---|"]
    for role, groups in roles.items():
        across = [g for g in groups if len({hosts.get(r, ('?', 0))[0] for r in g}) > 1]
        lines.append(f"| {role} | {len(groups)} x {len(groups[0]) if groups else 0} ranks |"
                     f" {', '.join(map(str, across)) if across else 'none'} |")
    if store_host is not None:
        lines += ["", f"If rank {store_host} dies the store goes with it: the others still write their captures"
                      " and name it, but through the shared folder only."]
    return "\n".join(lines)
