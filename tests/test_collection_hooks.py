"""The collection hook of tests/conftest.py: a schemathesis test gets one node id per API operation, so
pytest-xdist drops none when it spreads the tests (tests/unique_node_ids.py), and the files that start
processes run first (tests/file_order.py)."""

from __future__ import annotations

pytest_plugins = ["pytester"]

SCHEMA_TEST = '''
import schemathesis
SCHEMA = schemathesis.openapi.from_dict({
    "openapi": "3.1.0", "info": {"title": "t", "version": "1"},
    "paths": {"/a": {"get": {"responses": {"200": {"description": "ok"}}}},
              "/b": {"post": {"responses": {"200": {"description": "ok"}}}}},
})

@SCHEMA.parametrize()
def test_each_operation(case):
    pass
'''


def test_each_schemathesis_operation_has_its_own_node_id(pytester):
    """(Without the hook, pytest 9.2 and schemathesis 4.32 give both items `test_fuzzed.py::test_each_operation`.)"""
    pytester.makepyfile(test_fuzzed=SCHEMA_TEST)
    pytester.makeconftest("from tests.unique_node_ids import give_each_test_its_own_node_id\n"
                          "def pytest_collection_modifyitems(items):\n"
                          "    give_each_test_its_own_node_id(items)\n")
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    assert [item.nodeid for item in items] == ["test_fuzzed.py::test_each_operation[GET /a]",
                                               "test_fuzzed.py::test_each_operation[POST /b]"]


def test_integration_files_start_first_and_the_order_is_kept_otherwise():
    from types import SimpleNamespace

    from tests.file_order import integration_files_first

    names = ["tests/api/test_a.py::t1", "tests/integration/test_z.py::t1", "tests/api/test_a.py::t2",
             "tests/integration/test_b.py::t1", "tests/integration/test_z.py::t2", "tests/kv/test_k.py::t1"]
    items = [SimpleNamespace(nodeid=name) for name in names]
    integration_files_first(items)
    assert [item.nodeid for item in items] == [
        "tests/integration/test_z.py::t1", "tests/integration/test_b.py::t1", "tests/integration/test_z.py::t2",
        "tests/api/test_a.py::t1", "tests/api/test_a.py::t2", "tests/kv/test_k.py::t1"]
