"""The engine flags and ``EngineArgs`` are made from the config dataclasses: every user field of
``kiln.config`` has a flag with its default and its docstring, the class fields a platform fills
have none, and vLLM's flag spellings stay."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing

import pytest

from kiln.config import AUTO, DeviceConfig, KilnConfig
from kiln.engine.arg_utils import EngineArgs
from kiln.entrypoints.llm import LLM
from kiln.plugins.interfaces import CLASS_FIELDS

SECTIONS = {
    f.name: typing.get_type_hints(KilnConfig)[f.name] for f in dataclasses.fields(KilnConfig)
}
"""``KilnConfig``'s section classes, read here from ``KilnConfig`` itself."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


def _docstring(cls: type, name: str) -> str:
    """The string literal right under ``name: ...`` in ``cls``'s source, whitespace collapsed."""
    source = inspect.getsource(cls)
    match = re.search(
        rf'\n    {name}: [^\n]*(?:\n        [^\n]*)*\n(?:    \)\n)?    """(.*?)"""', source, re.S
    )
    assert match, f"{cls.__name__}.{name} has no docstring"
    return " ".join(match.group(1).split())


def _user_fields() -> list[tuple[str, type, dataclasses.Field]]:
    """``(flag name, section class, field)`` for every field a user sets by its own flag."""
    return [
        (f.metadata.get("flag", f.name), cls, f)
        for cls in SECTIONS.values()
        for f in dataclasses.fields(cls)
        if not (cls is DeviceConfig and f.name in CLASS_FIELDS)
        and "set_by" not in f.metadata
        and not f.metadata.get("internal")  # set by Kiln itself (a rank), never by a user
    ]


def test_every_user_field_is_a_flag_with_its_default_and_docstring_as_help() -> None:
    actions = {action.dest: action for action in _parser()._actions}
    for name, cls, f in _user_fields():
        action = actions.get(name)
        assert action is not None, f"{cls.__name__}.{f.name} has no flag"
        if not f.metadata.get("positional"):
            assert "--" + name.replace("_", "-") in action.option_strings
        if "parse" in f.metadata:  # the converter reads None as the default (checked below)
            assert action.default is None, name
        else:
            assert action.default == f.default, name
        assert " ".join(action.help.replace("%%", "%").split()) == _docstring(cls, f.name)
    converters = {name: f for name, _, f in _user_fields() if "parse" in f.metadata}
    for cls in SECTIONS.values():  # a field without a flag is set by a converter's flag
        assert all(
            f.metadata["set_by"] in converters
            for f in dataclasses.fields(cls)
            if "set_by" in f.metadata
        )
    # Every flag's default, converted, is the config's default: no flag changes what a config
    # made without arguments holds.
    assert EngineArgs.from_cli_args(_parser().parse_args([])).create_config() == KilnConfig()
    assert EngineArgs().create_config() == KilnConfig()


def test_class_fields_come_from_one_table_and_are_not_flags() -> None:
    filled_by_platform = [f.name for f in dataclasses.fields(DeviceConfig) if f.default == AUTO]
    assert filled_by_platform == list(CLASS_FIELDS)
    parser = _parser()
    for name in CLASS_FIELDS:
        with pytest.raises(SystemExit):
            parser.parse_args(["--" + name.replace("_", "-"), "x.Y"])
    assert not set(CLASS_FIELDS) & {f.name for f in dataclasses.fields(EngineArgs)}


def test_vllm_spellings_aliases_choices_and_converters() -> None:
    argv = ["m.gguf", "-q", "int8", "-tp", "2", "--dtype", "bfloat16", "--batch-invariant"]
    argv += ["--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--kv-cache-memory"]
    argv += ["40%", "--graph-capture-sizes", "1, 2,8", "--plugin-config", '{"x86": {"a": 1}}']
    argv += ["--distributed-executor-backend", "mp", "--max-num-seqs", "3", "--platform", "cpu"]
    argv += ["--structured-outputs-config", '{"disable_any_whitespace": true}']
    argv += ["--scheduling-policy", "priority", "--enable-expert-parallel"]
    config = EngineArgs.from_cli_args(_parser().parse_args(argv)).create_config()
    assert config.parallel.enable_expert_parallel is True
    assert config.structured_outputs.disable_any_whitespace is True
    assert config.scheduler.policy == "priority"
    assert (config.model.model, config.model.quantization) == ("m.gguf", "int8")
    assert (config.model.dtype, config.model.batch_invariant) == ("bfloat16", True)
    assert (config.parallel.tensor_parallel_size, config.parallel.distributed_executor_backend) == (
        2,
        "mp",
    )
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.enable_chunked_prefill is False
    assert (config.cache.kv_cache_memory, config.cache.kv_cache_memory_fraction) == (None, 0.4)
    assert config.device.graph_capture_sizes == (1, 2, 8)
    assert config.plugins.sections == {"x86": {"a": 1}}
    assert (config.scheduler.max_num_seqs, config.device.platform) == (3, "cpu")
    assert EngineArgs(kv_cache_memory=2).create_config().cache.kv_cache_memory == 2.0
    assert EngineArgs(plugin_config={"x86": {}}).create_config().plugins.sections == {"x86": {}}

    parser = _parser()
    for bad in (["--dtype", "fp64"], ["-q", "fp8"], ["--distributed-executor-backend", "mpi"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(SystemExit):  # off by default: no --no- form
        parser.parse_args(["--no-batch-invariant"])
    with pytest.raises(ValueError, match=r"kv_cache_memory='lots' is invalid; allowed: .*40%"):
        EngineArgs(kv_cache_memory="lots").create_config()
    with pytest.raises(ValueError, match="--plugin-config is not valid JSON"):
        EngineArgs(plugin_config="{").create_config()
    with pytest.raises(ValueError, match=r"scheduler.max_num_seqs=0 is invalid"):
        EngineArgs(max_num_seqs=0).create_config()


def test_unknown_keywords_are_refused_naming_the_allowed_ones() -> None:
    allowed = sorted(name for name, _, _ in _user_fields())
    for build in (EngineArgs.from_kwargs, LLM):
        with pytest.raises(ValueError) as info:
            build(max_seqs=4)
        message = str(info.value)
        assert message.startswith("unknown engine argument(s) ['max_seqs']; allowed: ")
        assert message.endswith(str(allowed))
    assert EngineArgs.from_kwargs(max_num_seqs=4).create_config().scheduler.max_num_seqs == 4
