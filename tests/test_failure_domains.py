"""Failure domains (cluster/domains.py) and redundancy placed across them (cluster/topology.py):
pure, over many topologies, no processes."""

import itertools
import math
import random
from collections import Counter

import pytest

from hpcckpt.cluster.domains import (
    DomainRules,
    domain_of_host,
    number_domains,
    parse_domain_rules,
    scheduler_domain,
    simulated_domain_of_node,
)
from hpcckpt.cluster.topology import Topology, node_losses_survived, simulated_node_of_rank
from hpcckpt.errors import ConfigError


# -- where a node's domain comes from ---------------------------------------------------------
def test_slurm_tree_topology_names_the_leaf_switch():
    environ = {"SLURM_TOPOLOGY_ADDR": "top.s2.n3", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"}
    assert scheduler_domain(environ) == "top.s2"
    assert domain_of_host("n3", parse_domain_rules("auto"), environ) == "top.s2"
    # No tree (a flat topology gives the node alone), or no Slurm: the node is its own domain.
    assert scheduler_domain({"SLURM_TOPOLOGY_ADDR": "n3", "SLURM_TOPOLOGY_ADDR_PATTERN": "node"}) == ""
    assert domain_of_host("n3", parse_domain_rules("auto"), {}) == "n3"
    # "nodes" ignores the scheduler's topology.
    assert domain_of_host("n3", parse_domain_rules("nodes"), environ) == "n3"


def test_a_site_map_wins_over_the_scheduler_and_unmatched_hosts_stand_alone(tmp_path):
    rules = parse_domain_rules("n[1-4]=rack1, n[5-8]=rack2")
    environ = {"SLURM_TOPOLOGY_ADDR": "top.s9.n2", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"}
    assert [domain_of_host(f"n{i}", rules, environ) for i in (1, 4, 5, 8)] == ["rack1", "rack1", "rack2", "rack2"]
    assert domain_of_host("login9", rules, {}) == "login9"
    mapping = tmp_path / "domains.txt"
    mapping.write_text("# site map\ncn0[0-3]*  chassis-a\ncn0[4-7]* chassis-b  # the second chassis\n\n")
    from_file = parse_domain_rules(str(mapping))
    assert from_file.site == (("cn0[0-3]*", "chassis-a"), ("cn0[4-7]*", "chassis-b"))
    assert domain_of_host("cn05.cluster", from_file, {}) == "chassis-b"


@pytest.mark.parametrize("setting,message", [
    ("/no/such/map.txt", "cannot be read"),
    ("n1=", "is not 'PATTERN DOMAIN'"),
    ("=rack1", "is not 'PATTERN DOMAIN'"),
])
def test_a_bad_site_map_is_a_clear_config_error(setting, message):
    with pytest.raises(ConfigError, match=message):
        parse_domain_rules(setting)


def test_an_empty_map_file_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="maps no host"):
        parse_domain_rules(str(empty))


def test_simulated_domains_are_blocks_of_nodes():
    assert simulated_domain_of_node(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert simulated_domain_of_node(5, 2) == (0, 0, 0, 1, 1)
    with pytest.raises(ConfigError, match="between 1 and the 3"):
        simulated_domain_of_node(3, 4)


def test_domains_are_numbered_in_node_order():
    assert number_domains(["s2", "s2", "s1", "s3", "s1"]) == ((0, 0, 1, 2, 1), ("s2", "s1", "s3"))


def test_the_config_refuses_simulated_domains_without_simulated_nodes(tmp_path):
    from hpcckpt.config import load_config

    job = tmp_path / "job.toml"
    job.write_text("[cluster]\nsimulated_domains = 2\n")
    with pytest.raises(ConfigError, match="simulated_nodes = 0"):
        load_config(job)
    job.write_text("[cluster]\nsimulated_nodes = 2\nsimulated_domains = 3\n")
    with pytest.raises(ConfigError, match="more than the 2 simulated"):
        load_config(job)
    job.write_text("[cluster]\nfailure_domains = \"/nowhere/domains.txt\"\n")
    with pytest.raises(ConfigError, match="job.toml: cluster.failure_domains"):
        load_config(job)


# -- placement across domains -----------------------------------------------------------------
def topology(ranks_per_node, domain_of_node):
    node_of_rank = tuple(n for n, count in enumerate(ranks_per_node) for _ in range(count))
    names = tuple(f"s{d}" for d in range(max(domain_of_node) + 1))
    return Topology(node_of_rank, tuple(domain_of_node), names)


def random_topologies(count=200, seed=7):
    rng = random.Random(seed)
    for _ in range(count):
        nodes = rng.randint(2, 12)
        per_node = rng.choice([1, 1, 2, 3])
        ranks = [per_node] * nodes if rng.random() < 0.7 else [rng.randint(1, 3) for _ in range(nodes)]
        domains = rng.randint(1, nodes)
        domain_of_node = [rng.randrange(domains) for _ in range(nodes)]
        # Domains numbered in node order, as discovery numbers them.
        renumber = {}
        domain_of_node = [renumber.setdefault(d, len(renumber)) for d in domain_of_node]
        yield topology(ranks, domain_of_node)


TOPOLOGIES = list(random_topologies())


@pytest.mark.parametrize("topo", TOPOLOGIES)
def test_partners_leave_the_node_always_and_the_domain_wherever_the_domains_allow(topo):
    partners = topo.partner_of()
    node_of, domain_of = topo.node_of_rank, topo.domain_of_rank
    assert all(node_of[r] != node_of[p] for r, p in enumerate(partners))
    # Node to node it is a permutation: every node holds the copies of exactly one other node.
    targets = {node_of[r]: node_of[p] for r, p in enumerate(partners)}
    assert sorted(targets.values()) == sorted(targets)
    nodes_in = Counter(topo.domain_of(n) for n in set(node_of))
    largest, total = max(nodes_in.values()), len(set(node_of))
    inside = [r for r, p in enumerate(partners) if domain_of[r] == domain_of[p]]
    if 2 * largest <= total:
        assert inside == []
        assert topo.partner_placement_warnings(partners) == ()
    else:
        # Only the domain holding more than half the nodes keeps copies, and as few as a
        # permutation allows: the other domains' nodes all send theirs into it.
        big = next(d for d, count in nodes_in.items() if count == largest)
        assert {domain_of[r] for r in inside} <= {big}
        assert len({node_of[r] for r in inside}) == (2 * largest - total if len(nodes_in) > 1 else total)
        if topo.has_domains and not topo.single_domain and inside:
            (warning,) = topo.partner_placement_warnings(partners)
            assert f"s{big} (" in warning


@pytest.mark.parametrize("topo", TOPOLOGIES)
@pytest.mark.parametrize("group_size,parity", [(2, 1), (3, 1), (4, 1), (4, 2), (6, 2)])
def test_groups_span_nodes_and_give_a_domain_the_fewest_members_possible(topo, group_size, parity):
    try:
        groups = topo.erasure_groups(group_size, parity)
    except Exception as exc:  # shapes no node-distinct groups fit: the node-only rules' errors
        assert "group_size" in str(exc)
        return
    node_of, domain_of = topo.node_of_rank, topo.domain_of_rank
    assert sorted(itertools.chain(*groups)) == list(range(topo.world_size))
    for group in groups:
        assert len({node_of[m] for m in group}) == len(group)
    ranks_in = Counter(domain_of)
    worst = 0
    for group in groups:
        for domain, count in Counter(domain_of[m] for m in group).items():
            # Pigeonhole: R ranks of a domain over G groups put ceil(R / G) in some group.
            assert count <= math.ceil(ranks_in[domain] / len(groups))
            worst = max(worst, count)
    warned = topo.group_placement_warnings(groups, parity)
    assert bool(warned) == (worst > parity and topo.has_domains and not topo.single_domain)


def test_every_node_its_own_domain_places_as_by_nodes_alone():
    for node_of_rank in (simulated_node_of_rank(8, 4), (0, 0, 1, 2, 2, 2, 3), (0, 1, 0, 1, 2, 2)):
        plain = Topology(node_of_rank)
        alone = Topology(node_of_rank, tuple(range(len(set(node_of_rank)))), tuple(f"n{i}" for i in range(4)))
        assert alone.partner_of() == plain.partner_of()
        assert alone.erasure_groups(2, 1) == plain.erasure_groups(2, 1)
        assert not alone.has_domains


def test_one_domain_for_all_nodes_places_as_by_nodes():
    node_of_rank = simulated_node_of_rank(8, 4)
    one = Topology(node_of_rank, (0, 0, 0, 0), ("top",))
    assert one.partner_of() == Topology(node_of_rank).partner_of()
    assert one.erasure_groups(4, 1) == Topology(node_of_rank).erasure_groups(4, 1)
    assert one.partner_placement_warnings(one.partner_of()) == ()
    assert one.group_placement_warnings(one.erasure_groups(4, 1), 1) == ()
    (warning,) = one.single_domain_warnings()
    assert "all 4 nodes of this job are in one failure domain (top)" in warning


def test_two_switches_of_four_survive_a_switch_where_nodes_alone_do_not():
    # The cluster: 8 nodes, leaf switches of 4, one rank per node, L1-L3 with groups of
    # 4 and parity 1, no L4.
    node_of_rank = tuple(range(8))
    switches = (0, 0, 0, 0, 1, 1, 1, 1)
    by_switch = Topology(node_of_rank, switches, ("s1", "s2"))
    by_node = Topology(node_of_rank)
    for topo in (by_switch, by_node):
        assert node_losses_survived(node_of_rank, partner_of=topo.partner_of(), groups=topo.erasure_groups(4, 1),
                                    parity=1) >= 1
    survived = {name: node_losses_survived(node_of_rank, partner_of=topo.partner_of(),
                                           groups=topo.erasure_groups(4, 1), parity=1, domain_of_rank=switches)
                for name, topo in (("switch", by_switch), ("node", by_node))}
    assert survived == {"switch": 1, "node": 0}
    # Four members of a group from two switches: more than parity 1 in one, whatever the deal.
    assert by_switch.group_placement_warnings(by_switch.erasure_groups(4, 1), 1)


def test_uneven_switches_keep_partners_apart():
    # Switches of 3, 2 and 1 nodes, two ranks per node: the largest is half of 6 nodes.
    topo = topology([2] * 6, [0, 0, 0, 1, 1, 2])
    partners = topo.partner_of()
    assert all(topo.domain_of_rank[r] != topo.domain_of_rank[p] for r, p in enumerate(partners))
    assert node_losses_survived(topo.node_of_rank, partner_of=partners, domain_of_rank=topo.domain_of_rank) == 1


def test_more_parity_than_domains_still_counts_domain_losses():
    # 2 switches of 3 nodes, groups of 6 with parity 4: a switch takes 3 members, within parity.
    node_of_rank = tuple(range(6))
    switches = (0, 0, 0, 1, 1, 1)
    topo = Topology(node_of_rank, switches, ("s1", "s2"))
    groups = topo.erasure_groups(6, 4)
    assert topo.group_placement_warnings(groups, 4) == ()
    assert node_losses_survived(node_of_rank, groups=groups, parity=4, domain_of_rank=switches) == 1
    assert node_losses_survived(node_of_rank, groups=groups, parity=4) == 4


def test_domain_rules_know_when_they_say_something():
    assert DomainRules(auto=True).known and not DomainRules(auto=False).known
