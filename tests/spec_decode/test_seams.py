"""The proposer and the rejection sampler are config strings a platform fills: the platform's
defaults, the interface checks (a missing method or another signature is an error naming the
class and the method), and ``kiln plugins`` listing both."""

from __future__ import annotations

import pytest

from kiln.config import KilnConfig
from kiln.platforms.cpu import CpuPlatform
from kiln.plugins.interfaces import InterfaceError, resolve_class
from kiln.spec_decode.interface import ProposalInputs
from kiln.testing import plugin_report


class NoPropose:
    def __init__(self, config, device) -> None: ...

    def load_model(self, target_model, platform) -> None: ...


class OtherSignature:
    def forward(self, logits, metadata, draft_token_ids) -> None: ...


class FixedProposer:
    """A platform's own proposer: matches the interface without subclassing it."""

    def __init__(self, config, device) -> None: ...

    def load_model(self, target_model, platform) -> None: ...

    def get_kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks) -> None: ...

    def propose(self, inputs: ProposalInputs) -> list[list[int]]:
        return [[1] for _ in inputs.rows]

    def draft_probs(self, req_ids, num_drafts) -> None:
        return None

    def remove_requests(self, req_ids) -> None: ...


def test_the_platform_fills_both_fields() -> None:
    config = CpuPlatform.check_and_update_config(KilnConfig())
    assert config.device.proposer_cls == "kiln.spec_decode.ngram.NgramProposer"
    assert config.device.rejection_sampler_cls == (
        "kiln.spec_decode.rejection_sampler.RejectionSampler"
    )
    for field in ("proposer_cls", "rejection_sampler_cls"):
        resolve_class(field, getattr(config.device, field))
    draft = KilnConfig().replace(
        speculative__method="draft_model",
        speculative__model="d.gguf",
        speculative__num_speculative_tokens=2,
    )
    config = CpuPlatform.check_and_update_config(draft)
    assert config.device.proposer_cls == "kiln.spec_decode.draft_model.DraftModelProposer"
    resolve_class("proposer_cls", config.device.proposer_cls)


def test_classes_that_do_not_match_are_named() -> None:
    with pytest.raises(
        InterfaceError,
        match=r"NoPropose lacks method 'get_kv_cache_bytes_per_block' of ProposerBase",
    ):
        resolve_class("proposer_cls", f"{__name__}.NoPropose")
    with pytest.raises(InterfaceError, match=r"OtherSignature.forward .*'draft_probs'"):
        resolve_class("rejection_sampler_cls", f"{__name__}.OtherSignature")
    assert resolve_class("proposer_cls", f"{__name__}.FixedProposer") is FixedProposer


@pytest.mark.plugin
def test_kiln_plugins_lists_and_checks_them() -> None:
    rc, report = plugin_report()
    assert rc == 0, report
    classes = {c["field"]: (c["class"], c["status"]) for c in report["classes"]}
    assert classes["proposer_cls"] == ("kiln.spec_decode.ngram.NgramProposer", "ok")
    assert classes["rejection_sampler_cls"] == (
        "kiln.spec_decode.rejection_sampler.RejectionSampler",
        "ok",
    )
