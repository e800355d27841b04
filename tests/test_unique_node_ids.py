"""The collection hook of tests/unique_node_ids.py: a schemathesis test collected as pytest-xdist's
workers collect it gets one node id per API operation, so none is dropped when tests are spread."""

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
    pytester.makeconftest("from tests.unique_node_ids import pytest_collection_modifyitems  # noqa: F401\n")
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    assert [item.nodeid for item in items] == ["test_fuzzed.py::test_each_operation[GET /a]",
                                               "test_fuzzed.py::test_each_operation[POST /b]"]
