"""Resolve-time interface checks name the class and the method."""

import pytest

from kiln.distributed.communicator import Communicator
from kiln.plugins.interfaces import InterfaceError, check_implements, resolve_class
from kiln.worker.graph import EagerGraphWrapper, GraphWrapper


class Iface:
    def run(self, batch, *, timeout: float = 1.0): ...

    @classmethod
    def make(cls, name): ...


class Good:
    def run(self, batch, extra=0, *, timeout: float = 1.0): ...

    @classmethod
    def make(cls, name): ...


class Missing:
    def run(self, batch, *, timeout: float = 1.0): ...


class Renamed(Good):
    def run(self, items, *, timeout: float = 1.0): ...


class ExtraRequired(Good):
    def run(self, batch, mode, *, timeout: float = 1.0): ...


class NoKeyword(Good):
    def run(self, batch): ...


class NotClassmethod(Good):
    def make(self, name): ...


class Flexible(Good):
    def run(self, *args, **kwargs): ...


def test_a_matching_class_passes_even_without_subclassing():
    check_implements(Good, Iface)
    check_implements(Flexible, Iface)
    check_implements(EagerGraphWrapper, GraphWrapper)


@pytest.mark.parametrize(
    ("cls", "needle"),
    [
        (Missing, "Missing lacks method 'make' of Iface"),
        (Renamed, "Renamed.run is incompatible with Iface.run: parameter 1 is 'items'"),
        (ExtraRequired, "requires parameter 'mode' that the interface does not pass"),
        (NoKeyword, "does not accept keyword 'timeout'"),
        (NotClassmethod, "must be a classmethod, is a method"),
    ],
)
def test_mismatches_name_the_class_and_method(cls, needle):
    with pytest.raises(InterfaceError, match=needle):
        check_implements(cls, Iface)


def test_an_abstract_subclass_lists_what_it_lacks():
    class Half(Communicator):
        def all_reduce(self, tensor):
            return tensor

    with pytest.raises(InterfaceError, match=r"does not implement \['__init__', 'all_gather'"):
        check_implements(Half, Communicator)


def test_resolve_class_imports_and_checks():
    assert resolve_class("graph_wrapper_cls", "kiln.worker.graph.EagerGraphWrapper") is (
        EagerGraphWrapper
    )
    with pytest.raises(ImportError, match="kiln.nowhere"):
        resolve_class("graph_wrapper_cls", "kiln.nowhere.Wrapper")
    with pytest.raises(InterfaceError, match="KilnConfig.__init__ is incompatible"):
        resolve_class("graph_wrapper_cls", "kiln.config.KilnConfig")
