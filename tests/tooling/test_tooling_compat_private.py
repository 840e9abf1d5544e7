"""tools/compat_private.py: which of a peer's tests reach into the peer's private internals
(private attributes of its objects, mocks of its private code), found in the test source."""

import importlib.util
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compat_private", ROOT / "tools" / "compat_private.py")
compat_private = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat_private)

PEER_SRC = '''
class Manager:
    def __init__(self):
        self._checkpointer = None
        self._helper_state = 1

    def _finalize(self):
        pass

    def save(self):
        pass
'''

# a private module of the peer: ``Hidden`` has no public counterpart, ``Manager`` has one
PRIVATE_MAP = {"peer._src.core": {"Hidden": [], "Manager": ["peer.Manager"]}}


def _analyze(tmp_path, test_src, helper_src=None, nodeids=()):
    pkg = tmp_path / "peer"
    (pkg / "_src").mkdir(parents=True, exist_ok=True)
    (pkg / "_src" / "core.py").write_text(PEER_SRC)
    test = tmp_path / "t_test.py"
    test.write_text(textwrap.dedent(test_src))
    helpers = {}
    if helper_src is not None:
        helper = pkg / "test_helpers.py"
        helper.write_text(textwrap.dedent(helper_src))
        helpers["peer.test_helpers"] = helper
    return compat_private.analyze("peer", PRIVATE_MAP, pkg, {"t_test.py": test}, helpers, list(nodeids))


def test_private_attribute_of_a_peer_object_counts_and_own_attributes_do_not(tmp_path):
    src = '''
    import peer
    import numpy as np

    class T:
        def setUp(self):
            self._helper_state = 3          # the test's own attribute (same name as the peer's)

        def test_reads(self):
            manager = peer.Manager()
            assert manager._checkpointer is None

        def test_own(self):
            assert self._helper_state == 3
            manager = peer.Manager()
            manager._helper_state            # owned by the test file: not counted

        def test_third_party(self):
            np._checkpointer                 # rooted in a non-peer import: not counted

        def test_public(self):
            peer.Manager().save()
    '''
    ids = [f"t_test.py::T::{n}" for n in ("test_reads", "test_own", "test_third_party", "test_public")]
    found = _analyze(tmp_path, src, nodeids=ids)
    assert found == {"t_test.py::T::test_reads": ["attribute ._checkpointer in test_reads"]}


def test_setting_a_peer_private_attribute_counts(tmp_path):
    src = '''
    class T:
        def test_sets(self):
            m = make()
            m._checkpointer = object()
            setattr(m, "_finalize", None)
    '''
    found = _analyze(tmp_path, src, nodeids=["t_test.py::T::test_sets"])
    assert found["t_test.py::T::test_sets"] == ["attribute ._checkpointer in test_sets",
                                                "setattr(..., '_finalize') in test_sets"]


def test_mocks_of_private_code_count_in_decorators_and_strings(tmp_path):
    src = '''
    from unittest import mock
    import datetime
    import peer
    from peer._src import core

    class T:
        @mock.patch.object(core.Hidden, "finalize")
        def test_decorated(self, _):
            pass

        def test_string(self):
            with mock.patch("peer._src.core.Hidden.finalize"):
                pass

        def test_private_method(self):
            with mock.patch.object(peer.Manager, "_finalize"):
                pass

        def test_private_module_binding(self):
            with mock.patch.object(core, "Manager"):    # public object, the private module's name
                pass

        def test_public_mocks(self):
            with mock.patch.object(core.Manager, "save"), mock.patch("datetime.datetime"):
                pass
    '''
    ids = [f"t_test.py::T::{n}" for n in ("test_decorated", "test_string", "test_private_method",
                                        "test_private_module_binding", "test_public_mocks")]
    found = _analyze(tmp_path, src, nodeids=ids)
    assert sorted(found) == sorted(ids[:4]), found
    assert found[ids[0]] == ["mock.patch.object(peer._src.core.Hidden, 'finalize') in test_decorated",
                             "peer._src.core.Hidden in test_decorated"]


def test_helpers_parameterized_names_and_base_classes_in_helper_files(tmp_path):
    helper = '''
    class Base:
        class Test:
            def test_inherited(self):
                self.check(make())

            def check(self, m):
                assert m._checkpointer is None
    '''
    src = '''
    from peer import test_helpers

    def peek(m):
        return m._finalize

    class T(test_helpers.Base.Test):
        def test_calls_function(self):
            peek(object())

        def test_param(self, x):
            pass
    '''
    ids = ["t_test.py::T::test_inherited", "t_test.py::T::test_calls_function", "t_test.py::T::test_param0"]
    found = _analyze(tmp_path, src, helper, nodeids=ids)
    assert found == {"t_test.py::T::test_inherited": ["attribute ._checkpointer in check"],
                     "t_test.py::T::test_calls_function": ["attribute ._finalize in peek"]}


def test_set_up_reaching_in_makes_every_test_of_the_class_private(tmp_path):
    src = '''
    class T:
        def setUp(self):
            self.m = make()
            self.m._helper_state = 0

        def test_a(self):
            pass
    '''
    found = _analyze(tmp_path, src, nodeids=["t_test.py::T::test_a"])
    assert found == {"t_test.py::T::test_a": ["attribute ._helper_state in setUp"]}


def test_private_module_names_count_in_the_tests_own_code_not_in_test_utilities(tmp_path):
    helper = '''
    from peer._src import core

    def environment():
        return core.Hidden                  # a test utility's set-up: not counted

    class Base:
        def test_in_base(self):
            return core.Hidden              # a test written in a helper file: counted
    '''
    src = '''
    from peer._src import core
    from peer import test_helpers

    class T(test_helpers.Base):
        def test_own(self):
            core.Hidden

        def test_utility(self):
            test_helpers.environment()

        def test_public_through_private(self):
            core.Manager
    '''
    ids = ["t_test.py::T::test_own", "t_test.py::T::test_utility", "t_test.py::T::test_in_base",
           "t_test.py::T::test_public_through_private"]
    found = _analyze(tmp_path, src, helper, nodeids=ids)
    assert found == {"t_test.py::T::test_own": ["peer._src.core.Hidden in test_own"],
                     "t_test.py::T::test_in_base": ["peer._src.core.Hidden in test_in_base"]}


def test_a_namedtuples_underscore_methods_are_public(tmp_path):
    src = '''
    class T:
        def test_nt(self):
            m = make()
            m._replace(a=1)._asdict()       # the peer defines a _replace too: still public
            m._checkpointer
    '''
    (tmp_path / "peer" / "_src").mkdir(parents=True)
    (tmp_path / "peer" / "_src" / "nt.py").write_text("class S:\\n    def _replace(self):\\n        pass\\n")
    found = _analyze(tmp_path, src, nodeids=["t_test.py::T::test_nt"])
    assert found == {"t_test.py::T::test_nt": ["attribute ._checkpointer in test_nt"]}
