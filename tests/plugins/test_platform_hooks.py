"""The Platform hooks a plugin overrides to describe and set up its processes: ``device_info``
(shown by ``kiln plugins``), ``init_process(role, config)`` (once per process, after configure),
and the check at selection that an overridden hook keeps the signature the core calls."""

import pytest

from kiln.config import KilnConfig
from kiln.platforms.cpu import CpuPlatform
from kiln.plugins.discovery import PLATFORM_GROUP, PluginRecord
from kiln.plugins.introspection import build_report, format_report
from kiln.plugins.manager import PlatformChoice, PlatformSelectionError, PluginManager

CALLS: list[tuple[str, KilnConfig]] = []


class HookedPlatform(CpuPlatform):
    name = "hooked"
    config_section = None

    @classmethod
    def device_info(cls):
        return {"isa": ["avx2", "avx512"], "cores": "0-1"}

    @classmethod
    def init_process(cls, role, config):
        CALLS.append((role, config))


class BrokenInfoPlatform(HookedPlatform):
    @classmethod
    def device_info(cls):
        raise OSError("no /proc here")


class WrongHookPlatform(CpuPlatform):
    name = "wrong_hook"
    config_section = None

    @classmethod
    def init_process(cls, config):  # the core passes (role, config)
        pass


def _manager(platform_cls, role="engine"):
    manager = PluginManager(role=role)
    manager.choice = PlatformChoice(platform_cls.name, "test", "test", platform_cls)
    return manager


def test_init_process_runs_once_with_the_role_and_the_config():
    CALLS.clear()
    manager, config = _manager(HookedPlatform), KilnConfig()
    manager.init_platform_process(config)
    manager.init_platform_process(config)
    assert CALLS == [("engine", config)]
    assert manager.phases == ["init-process"]


def test_device_info_is_in_the_report_and_its_text():
    report = build_report(_manager(HookedPlatform), None)
    assert report["platform"]["device_info"] == {"isa": ["avx2", "avx512"], "cores": "0-1"}
    assert "  device: isa=avx2,avx512 cores=0-1" in format_report(report)


def test_a_device_info_that_raises_is_reported_not_fatal():
    report = build_report(_manager(BrokenInfoPlatform), None)
    assert report["platform"]["device_info"] == {"error": "OSError: no /proc here"}


def test_a_hook_overridden_with_another_signature_is_refused_at_selection():
    record = PluginRecord(PLATFORM_GROUP, "wrong_hook", "test:detect", "test 0.1")
    record.status, record.detail = "active", f"{__name__}.WrongHookPlatform"
    manager = PluginManager()
    with pytest.raises(PlatformSelectionError, match="WrongHookPlatform.init_process") as err:
        manager._choose(record, "test")
    assert "'role'" in str(err.value)
    assert record.status == "refused" and manager.choice is None
