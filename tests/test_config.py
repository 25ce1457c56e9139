"""Config values are validated with messages naming the field; replace/diff track changes."""

import pytest

from kiln.config import CacheConfig, KilnConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kiln.plugins.config import PluginConfigRegistry


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: ModelConfig(dtype="float8"), "model.dtype='float8' is invalid; allowed: one of"),
        (lambda: ModelConfig(max_model_len=0), "model.max_model_len=0 is invalid"),
        (lambda: CacheConfig(block_size=12), "cache.block_size=12 is invalid; allowed: a power"),
        (lambda: CacheConfig(kv_cache_memory=-1), "cache.kv_cache_memory=-1 is invalid"),
        (lambda: SchedulerConfig(max_num_seqs=0), "scheduler.max_num_seqs=0 is invalid"),
        (lambda: ParallelConfig(distributed_executor_backend="mpi"), "'mpi' is invalid"),
    ],
)
def test_invalid_values_name_field_value_and_allowed(make, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        make()


def test_every_field_has_a_default_and_a_docstring():
    import ast
    import inspect
    import textwrap

    from kiln.config import SECTIONS

    for section in SECTIONS.values():
        (node,) = ast.parse(textwrap.dedent(inspect.getsource(section))).body
        assert isinstance(node, ast.ClassDef)
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                assert stmt.value is not None, f"{node.name}.{stmt.target.id} has no default"
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), (
                    f"{node.name}.{stmt.target.id} has no docstring"
                )


def test_replace_validates_and_diff_lists_changes():
    config = KilnConfig()
    new = config.replace(scheduler__max_num_seqs=8, device__worker_cls="x.W")
    assert config.scheduler.max_num_seqs == 64  # frozen: the original is untouched
    assert config.diff(new) == [
        ("scheduler.max_num_seqs", 64, 8),
        ("device.worker_cls", "auto", "x.W"),
    ]
    with pytest.raises(ValueError, match=r"scheduler.max_seqs is not a config field"):
        config.replace(scheduler__max_seqs=1)
    with pytest.raises(ValueError, match="section__field"):
        config.replace(max_num_seqs=1)
    with pytest.raises(ValueError, match="cache.block_size=3 is invalid"):
        config.replace(cache__block_size=3)


def test_plugin_config_schema_must_be_a_dataclass_with_defaults():
    from dataclasses import dataclass

    registry = PluginConfigRegistry()
    with pytest.raises(TypeError, match="must be a dataclass"):
        registry.declare("p", dict)

    @dataclass(frozen=True)
    class NoDefault:
        x: int

    with pytest.raises(TypeError, match="p.x needs a default"):
        registry.declare("p", NoDefault)

    @dataclass(frozen=True)
    class Opts:
        x: int = 1
        y: float | None = None

    registry.declare("p", Opts)
    assert registry.validate({"p": {"x": 2, "y": 0.5}})["p"] == Opts(2, 0.5)
    assert registry.validate({})["p"] == Opts()
    with pytest.raises(ValueError, match=r"p.x=True is invalid; allowed: int"):
        registry.validate({"p": {"x": True}})


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"runner": "embed"}, "model.runner='embed' is invalid"),
        ({"pooler_config": '{"pooling_type": "MAX"}'}, "model.pooling_type='MAX' is invalid"),
        ({"pooler_config": '{"normalise": true}'}, "pooler_config="),
        ({"pooler_config": "{"}, "--pooler-config is not valid JSON"),
        ({"pooler_config": '{"normalize": "yes"}'}, "model.pooling_normalize='yes' is invalid"),
        (
            {
                "runner": "pooling",
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
            },
            "speculative.method='ngram' is invalid with model.runner='pooling'",
        ),
    ],
)
def test_pooling_flags_refuse_bad_values(kwargs, needle):
    from kiln.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs.from_kwargs(**kwargs).create_config()


def test_pooler_config_sets_type_and_normalize():
    from kiln.engine.arg_utils import EngineArgs

    config = EngineArgs.from_kwargs(
        runner="pooling", pooler_config='{"pooling_type": "mean", "normalize": false}'
    ).create_config()
    assert (config.model.runner, config.model.pooling_type) == ("pooling", "MEAN")
    assert config.model.pooling_normalize is False
    default = EngineArgs.from_kwargs().create_config().model
    assert (default.runner, default.pooling_type, default.pooling_normalize) == (
        "generate",
        "LAST",
        True,
    )
