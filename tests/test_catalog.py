"""The offline catalog (tools/catalog.py): what inspect says of the levels."""


def test_inspect_says_how_far_l4_lags_the_node_local_levels():
    from hpcckpt.tools.catalog import VersionOverview, l4_lag

    def version(step, levels, assembled=""):
        return VersionOverview(step, levels, 4, 1, 1, {}, assembled)

    assert l4_lag([]) == "L4 holds no version yet"
    assert l4_lag([version(10, ("local",))]) == "L4 holds no version yet; node-local levels hold up to step 10"
    assert l4_lag([version(10, ("local", "pfs")), version(20, ("pfs",))]) == \
        "L4 is up to date: it holds the newest version (step 20)"
    # 30 is whole on no level after a node loss but a restart assembles it: it counts as ahead.
    lagging = [version(10, ("pfs",)), version(20, ("local", "partner")), version(30, (), "3 from L1 local")]
    assert l4_lag(lagging) == ("L4 lags: newest there is step 10, 2 newer version(s) only on node-local levels "
                               "(up to step 30, 20 step(s) ahead)")
