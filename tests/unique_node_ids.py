"""Every collected test gets its own node id.

schemathesis (4.x, under pytest 9) names each operation's test
`test_x[POST /v1/completions]` but leaves every one of them the node id of
the bare function, `file.py::test_x`. Serially that only blurs the report;
under pytest-xdist, which schedules and reports by node id, the five
operations of one test collapse into one and four never run. This gives
such a test the node id its name says (tests/test_collection_hooks.py).
"""

from __future__ import annotations


def give_each_test_its_own_node_id(items: list) -> None:
    """Mends pytest's collected `items` in place."""
    for item in items:
        own_id = f"{item.parent.nodeid}::{item.name}"
        if item.nodeid == own_id or not item.nodeid.endswith("::" + item.originalname):
            continue
        if hasattr(item, "_id"):  # pytest 9 keeps the id structured
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(own_id)
        else:
            item._nodeid = own_id
