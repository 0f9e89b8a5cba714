"""The restore plan over an old job's shards (repartition/plan.py): pure, no processes.

Every placement of 2-6 old ranks on 2-4 nodes, every set of lost nodes, with and without
partner copies, erasure groups and L4: the plan is complete exactly when the levels the
version had can bring every lost shard back, and it only ever names a source a surviving
new rank can read.
"""

import itertools

import pytest

from hpcckpt.cluster.topology import Topology, simulated_node_of_rank
from hpcckpt.levels.stripes import stripe_plan
from hpcckpt.levels.survey import NodeLocalView, Writing
from hpcckpt.repartition.plan import plan_repartition


def old_job(world, nodes, partner, group_size, parity):
    topo = Topology(simulated_node_of_rank(world, nodes))
    partner_of = topo.partner_of() if partner else ()
    groups = topo.erasure_groups(group_size, parity) if group_size else ()
    return topo, partner_of, groups


def views_after_loss(topo, partner_of, groups, lost_nodes, step=10):
    """What each surviving node's directory holds, one view per old node (a new rank there)."""
    writing = Writing("id", 1.0, topo.world_size, "run", groups, 0)
    views = []
    for node in sorted(set(topo.node_of_rank) - set(lost_nodes)):
        ranks = topo.ranks_on_node(node)
        replicas = frozenset((s, h) for s, h in enumerate(partner_of) if h in ranks)
        parity = frozenset(r for g in groups for r in g if r in ranks)
        views.append(NodeLocalView(step, f"/node{node}/v{step}", writing, frozenset(ranks), frozenset(ranks),
                                   replicas, parity))
    return views


def recoverable(topo, partner_of, groups, parity, lost_nodes) -> bool:
    node = topo.node_of_rank
    for rank in range(topo.world_size):
        if node[rank] not in lost_nodes:
            continue
        if partner_of and node[partner_of[rank]] not in lost_nodes:
            continue
        group = next((g for g in groups if rank in g), ())
        # With data of partner-covered members counted, a group survives p lost data shards.
        gone = [m for m in group if node[m] in lost_nodes and not (partner_of and node[partner_of[m]] not in lost_nodes)]
        if group and len(gone) <= parity and _stripes_ok(group, parity, topo, partner_of, lost_nodes):
            continue
        return False
    return True


def _stripes_ok(group, parity, topo, partner_of, lost_nodes) -> bool:
    node = topo.node_of_rank
    k = len(group) - parity
    for stripe in stripe_plan(len(group), parity):
        readable = 0
        for block in range(len(group)):
            member = group[stripe.member_of_block(block)]
            alive = node[member] not in lost_nodes
            if block < k:
                readable += alive or bool(partner_of and node[partner_of[member]] not in lost_nodes)
            else:
                readable += alive
        if readable < k:
            return False
    return True


CASES = [(w, n, partner, g, p) for w in range(2, 7) for n in range(2, min(w, 4) + 1)
         for partner in (False, True) for g, p in ((0, 0), (2, 1), (3, 1), (3, 2), (4, 2))
         if g <= n and (not g or w // g >= -(-w // n))]


@pytest.mark.parametrize("world,nodes,partner,group_size,parity", CASES)
def test_the_plan_is_complete_exactly_when_the_levels_allow(world, nodes, partner, group_size, parity):
    topo, partner_of, groups = old_job(world, nodes, partner, group_size, parity)
    writing = Writing("id", 1.0, world, "run", groups, parity)
    for count in range(0, nodes):
        for lost in itertools.combinations(range(nodes), count):
            views = views_after_loss(topo, partner_of, groups, set(lost))
            plan = plan_repartition(10, writing, views, pfs_holds=False)
            assert plan.complete == recoverable(topo, partner_of, groups, parity, set(lost)), (lost, plan)
            for source in plan.sources:
                if source is None:
                    continue
                if source.level in ("local", "partner"):
                    assert source.path.startswith(views[source.provider].directory)
                if source.level == "local":
                    assert source.old_rank in views[source.provider].shards
                if source.level == "partner":
                    assert any(s == source.old_rank for s, _ in views[source.provider].replicas)
            for rebuild in plan.rebuilds:
                assert {b.stripe for b in rebuild.blocks} == set(range(len(rebuild.members)))
                for block in rebuild.blocks:
                    if block.path is not None:
                        assert block.member in views[block.provider].parity
            # With L4, every shard has a source, and L4 serves only what nothing else can.
            with_l4 = plan_repartition(10, writing, views, pfs_holds=True)
            assert with_l4.complete
            assert [s.old_rank for s in with_l4.sources if s.level == "pfs"] == list(plan.missing)


def test_cheapest_source_first_and_reads_spread_over_the_ranks_that_see_them():
    topo, partner_of, groups = old_job(8, 4, True, 4, 2)
    writing = Writing("id", 1.0, 8, "run", groups, 2)
    views = views_after_loss(topo, partner_of, groups, {3})
    # Two new ranks per surviving node, seeing the same directory.
    views = [v for v in views for _ in range(2)]
    plan = plan_repartition(10, writing, views, pfs_holds=True)
    levels = [s.level for s in plan.sources]
    assert levels == ["local"] * 6 + ["partner"] * 2
    load = [sum(1 for s in plan.sources if s.provider == j) for j in range(6)]
    assert max(load) - min(load) <= 1


def test_bad_sources_are_planned_around():
    topo, partner_of, groups = old_job(4, 4, True, 4, 2)
    writing = Writing("id", 1.0, 4, "run", groups, 2)
    views = views_after_loss(topo, partner_of, groups, {3})
    plan = plan_repartition(10, writing, views, False, frozenset({("partner", 3)}))
    assert plan.sources[3].level == "erasure" and plan.complete
    plan = plan_repartition(10, writing, views, True, frozenset({("partner", 3), ("erasure", 3)}))
    assert plan.sources[3].level == "pfs"
    plan = plan_repartition(10, writing, views, False, frozenset({("partner", 3), ("parity", 0), ("parity", 1)}))
    assert plan.missing == (3,)


def test_another_writing_of_the_same_step_is_never_used():
    topo, partner_of, groups = old_job(4, 4, False, 0, 0)
    views = views_after_loss(topo, partner_of, groups, set())
    other = Writing("another", 2.0, 4, "run", (), 0)
    plan = plan_repartition(10, other, views, pfs_holds=False)
    assert plan.missing == (0, 1, 2, 3)
