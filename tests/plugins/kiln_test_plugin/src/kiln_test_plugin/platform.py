"""The test platforms: a CPU device under another name, naming its own classes."""

from __future__ import annotations

import os

from kiln.plugin_api import CpuPlatform, KilnConfig


class TestPlatform(CpuPlatform):
    name = "kiln_test"
    supported_dtypes = ("float32",)
    # Its general plugin declares the "kiln_test" config section; the platform adds none.
    config_section = None

    @classmethod
    def check_and_update_config(cls, config: KilnConfig) -> KilnConfig:
        bad = os.environ.get("KILN_TEST_BAD_CLASS")
        communicator = {
            "missing": "kiln_test_plugin.classes.CommunicatorMissingMethod",
            "signature": "kiln_test_plugin.classes.CommunicatorWrongSignature",
            "unresolvable": "kiln_test_plugin.classes.NoSuchCommunicator",
            "copy-reduce": "kiln_test_plugin.classes.CopyReduceCommunicator",
        }.get(bad or "", "kiln_test_plugin.classes.LoggingCommunicator")
        scheduler = {
            "over-budget": "kiln_test_plugin.classes.OverBudgetScheduler",
            "dynamic": "kiln_test_plugin.classes.DynamicBatchScheduler",
        }.get(bad or "", "kiln_test_plugin.classes.TestScheduler")
        attention = {
            "attention": "kiln_test_plugin.classes.DuckTypedAttentionBackend",
            "chunk-blind": "kiln_test_plugin.classes.ChunkBlindAttentionBackend",
        }.get(bad or "")
        if attention:
            config = config.replace(device__attention_backend=attention)
        config = config.replace(
            device__worker_cls="kiln_test_plugin.classes.TestWorker",
            device__model_runner_cls=(
                "kiln_test_plugin.classes.InterfaceOnlyModelRunner"
                if os.environ.get("KILN_TEST_RUNNER") == "interface-only"
                else "kiln_test_plugin.classes.TestModelRunner"
            ),
            device__scheduler_cls=scheduler,
            device__communicator_cls=communicator,
            device__graph_wrapper_cls="kiln_test_plugin.classes.CountingGraphWrapper",
            scheduler__max_num_seqs=min(config.scheduler.max_num_seqs, 8),
        )
        return super().check_and_update_config(config)


class SecondPlatform(CpuPlatform):
    name = "kiln_test_b"


class OldApiPlatform(CpuPlatform):
    name = "kiln_test_old"
    api_version = "0.9"


class MisnamedPlatform(CpuPlatform):
    """Returned by the ``kiln_test`` entry point, but named otherwise: Kiln refuses it."""

    name = "kiln_test_device"
