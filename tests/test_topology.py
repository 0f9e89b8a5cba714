import itertools

import pytest

from hpcckpt.cluster.topology import (
    Topology,
    job_id,
    node_ids_from_hostnames,
    node_losses_survived,
    simulated_node_of_rank,
)
from hpcckpt.errors import TopologyError

SHAPES = [(w, n) for w in range(1, 33) for n in range(1, w + 1)]


@pytest.mark.parametrize("world,nodes", SHAPES)
def test_simulated_placement_is_blocks_of_near_equal_size(world, nodes):
    placement = simulated_node_of_rank(world, nodes)
    assert len(placement) == world
    assert list(placement) == sorted(placement)
    sizes = [placement.count(n) for n in range(nodes)]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_more_simulated_nodes_than_ranks_is_clear_error():
    with pytest.raises(TopologyError, match="simulated_nodes = 5 but only 4 ranks"):
        simulated_node_of_rank(4, 5)


def _uneven_placements():
    yield (0, 0, 0, 1, 2)
    yield (0, 1, 1, 1, 2, 2)
    yield (0, 0, 1, 2, 2, 2, 3)
    yield (0, 1, 0, 1, 2, 2)  # ranks of a node need not be contiguous on a real cluster


@pytest.mark.parametrize("placement", [simulated_node_of_rank(w, n) for w, n in SHAPES if n >= 2]
                         + list(_uneven_placements()))
def test_partner_is_on_another_node(placement):
    topo = Topology(tuple(placement))
    partners = topo.partner_of()
    for rank, partner in enumerate(partners):
        assert placement[partner] != placement[rank]
    # Equal-sized nodes: every rank holds exactly one replica.
    sizes = {placement.count(n) for n in set(placement)}
    if len(sizes) == 1:
        assert sorted(partners) == list(range(len(placement)))


def test_partner_on_single_node_is_clear_error():
    with pytest.raises(TopologyError, match="at least 2 nodes"):
        Topology((0, 0, 0)).partner_of()


def test_losing_one_node_never_loses_shard_and_replica():
    topo = Topology(simulated_node_of_rank(8, 4))
    partners = topo.partner_of()
    for lost in range(4):
        for rank in range(8):
            assert not (topo.node_of_rank[rank] == lost and topo.node_of_rank[partners[rank]] == lost)


@pytest.mark.parametrize("world,nodes", [(w, n) for w, n in SHAPES if n >= 2])
@pytest.mark.parametrize("group_size,parity", [(2, 1), (3, 1), (4, 2), (5, 2)])
def test_erasure_groups_cover_all_ranks_on_distinct_nodes(world, nodes, group_size, parity):
    topo = Topology(simulated_node_of_rank(world, nodes))
    if group_size > nodes:
        with pytest.raises(TopologyError, match="distinct nodes"):
            topo.erasure_groups(group_size, parity)
        return
    busiest = max(topo.node_of_rank.count(n) for n in range(nodes))
    if busiest > world // group_size:
        # Each group holds at most one rank per node, so the busiest node needs that many groups.
        with pytest.raises(TopologyError, match="a node holds"):
            topo.erasure_groups(group_size, parity)
        return
    groups = topo.erasure_groups(group_size, parity)
    flat = sorted(itertools.chain.from_iterable(groups))
    assert flat == list(range(world)), "every rank is in exactly one group"
    for group in groups:
        assert len(group) >= group_size
        group_nodes = [topo.node_of_rank[r] for r in group]
        assert len(set(group_nodes)) == len(group_nodes), "one rank per node in a group"


def test_groups_of_8_ranks_on_4_nodes():
    topo = Topology(simulated_node_of_rank(8, 4))
    assert topo.erasure_groups(4, 2) == ((1, 3, 5, 7), (0, 2, 4, 6))


def test_uneven_nodes_leftovers_join_last_groups():
    # 7 ranks on nodes of sizes 2,2,2,1: one group of 4 and leftovers folded in.
    topo = Topology((0, 0, 1, 1, 2, 2, 3))
    groups = topo.erasure_groups(3, 1)
    assert sorted(len(g) for g in groups) == [3, 4]
    assert len(groups[-1]) >= len(groups[0])
    for g in groups:
        assert len({topo.node_of_rank[r] for r in g}) == len(g)


def test_impossible_groups_are_clear_error():
    # Node 0 holds 3 of 5 ranks: groups of 2 on distinct nodes would need 3 groups = 6 ranks.
    with pytest.raises(TopologyError, match="a node holds 3 ranks"):
        Topology((0, 0, 0, 1, 2)).erasure_groups(2, 1)
    with pytest.raises(TopologyError, match="parity"):
        Topology((0, 1, 2, 3)).erasure_groups(2, 2)


def test_hostnames_number_nodes_by_first_rank():
    assert node_ids_from_hostnames(["b", "b", "a", "c", "a"]) == (0, 0, 1, 2, 1)


def test_job_id_from_batch_system():
    assert job_id({"SLURM_JOB_ID": "1234"}) == "1234"
    assert job_id({"PBS_JOBID": "99.pbs-server"}) == "99"
    assert job_id({}) == "local"


def test_node_losses_survived_per_level_combination():
    from hpcckpt.cluster.topology import node_losses_survived

    four = (0, 1, 2, 3)
    assert node_losses_survived(four) == 0  # L1 alone
    assert node_losses_survived(four, partner=True) == 1
    assert node_losses_survived(four, group_size=4, parity=2) == 2
    assert node_losses_survived(four, partner=True, group_size=4, parity=1) == 1
    assert node_losses_survived(four, pfs=True) is None
    # 8 ranks on 4 nodes, two groups of 4 with parity 2: any 2 nodes, never 3.
    assert node_losses_survived((0, 0, 1, 1, 2, 2, 3, 3), group_size=4, parity=2) == 2
    # Partner copies on a ring of 6 nodes: 2 non-adjacent losses are fine, adjacent are not.
    assert node_losses_survived(tuple(range(6)), partner=True) == 1


def test_node_losses_survived_matches_brute_force_recovery_rule():
    """Cross-check the enumeration against an independent statement of the rule for L2+L3."""
    from itertools import combinations

    from hpcckpt.cluster.topology import Topology, node_losses_survived

    placement = (0, 1, 2, 3, 4, 5)
    topology = Topology(placement)
    partners = topology.partner_of()
    for parity in (1, 2):
        group = topology.erasure_groups(6, parity)[0]
        expected = 0
        for count in range(1, 7):
            ok = all(all(r not in lost or partners[r] not in lost or sum(m in lost for m in group) <= parity
                         for r in range(6)) for lost in map(set, combinations(range(6), count)))
            if not ok:
                break
            expected = count
        assert node_losses_survived(placement, partner=True, group_size=6, parity=parity) == expected


@pytest.mark.parametrize("world,nodes", [(w, n) for w, n in SHAPES if w <= 12])
@pytest.mark.parametrize("group_size,parity", [(4, 2), (4, 1), (8, 3), (2, 1)])
def test_fitted_redundancy_always_builds_groups_on_distinct_nodes(world, nodes, group_size, parity):
    """Targets, not preconditions: whatever the job finds, the fitted groups are valid, as
    large as the target allows, and any reduction is said."""
    from hpcckpt.cluster.topology import fit_redundancy

    topo = Topology(simulated_node_of_rank(world, nodes))
    fitted = fit_redundancy(topo, True, True, group_size, parity)
    assert fitted.partner == (nodes >= 2)
    if fitted.group_size:
        assert 2 <= fitted.group_size <= min(group_size, nodes)
        assert 1 <= fitted.parity <= min(parity, fitted.group_size - 1)
        groups = topo.erasure_groups(fitted.group_size, fitted.parity)  # raises if not valid
        for group in groups:
            assert len({topo.node_of_rank[r] for r in group}) == len(group)
    else:
        assert nodes == 1 or world // 2 < max(len(topo.ranks_on_node(n)) for n in range(nodes))
    changed = (fitted.group_size, fitted.parity) != (group_size, parity) or not fitted.partner
    assert bool(fitted.warnings) == changed


def test_fitted_redundancy_names_what_protection_is_left():
    from hpcckpt.cluster.topology import fit_redundancy

    fitted = fit_redundancy(Topology((0, 1, 2)), True, True, 4, 2)
    assert (fitted.group_size, fitted.parity) == (3, 2)
    assert fitted.warnings == ("resilience.group_size = 4, parity = 2 do not fit 3 rank(s) on 3 node(s): erasure "
                               "groups of 3+ ranks with parity 2 instead (each group survives the loss of 2 of its "
                               "nodes)",)
    alone = fit_redundancy(Topology((0, 0)), True, True, 4, 2)
    assert not alone.partner and alone.group_size == 0
    assert [w.split(":")[0] for w in alone.warnings] == ["partner copies (L2) are off", "erasure coding (L3) is off"]


def test_losses_survived_count_the_ranks_already_missing():
    """A version one rank's node could not take (4 nodes, partners, a group of 4 with parity
    2): it survives one more node loss, not two, and none where a group lost too many."""
    nodes = (0, 1, 2, 3)
    assert node_losses_survived(nodes, partner=True, group_size=4, parity=2) == 2
    assert node_losses_survived(nodes, partner=True, group_size=4, parity=2, missing={2}) == 1
    assert node_losses_survived(nodes, partner=False, group_size=4, parity=2, missing={1, 2}) == 0
    assert node_losses_survived(nodes, partner=False, group_size=4, parity=2, missing={0, 1, 2}) == 0
    assert node_losses_survived(nodes, partner=True, missing={2}) == 0  # only L2: its holder is the next loss
