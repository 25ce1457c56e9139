"""The Platform contract: everything Kiln asks of a piece of hardware.

A platform is a class of classmethods (never instantiated). The core reads its identity and
capabilities as data, asks it about devices and memory, lets it adjust the config once through
``check_and_update_config``, and instantiates the classes it names by dotted path (worker, model
runner, scheduler, attention backend, communicator, graph wrapper, speculative-decoding proposer
and rejection sampler), resolved lazily so importing a platform module costs nothing.

Versioning: ``api_version`` is ``"MAJOR.MINOR"``. A platform built against a different MAJOR than
``PLATFORM_API_VERSION`` is refused at load with both versions in the message; MINOR additions are
backwards compatible (new methods get defaults here).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kiln.config import AUTO
from kiln.plugins.interfaces import CLASS_FIELDS

if TYPE_CHECKING:
    from kiln.config import KilnConfig
    from kiln.model_executor.layers.linear import QuantizationConfig

logger = logging.getLogger(__name__)

PLATFORM_API_VERSION = "1.0"
"""The version of this contract. Bump MAJOR for breaking changes, MINOR for additions."""


class Platform:
    """Base of every platform. Subclasses override class attributes and classmethods."""

    # -- identity ---------------------------------------------------------------------------
    api_version: ClassVar[str] = PLATFORM_API_VERSION
    """The contract version this platform was written against."""
    name: ClassVar[str] = "unspecified"
    """Short name, used by ``--platform``, ``KILN_PLATFORM``, ``--plugin-config`` and in logs. It
    must equal the name of the ``kiln.platform_plugins`` entry point whose detector returns this
    class (Kiln refuses the platform at selection otherwise)."""
    device_type: ClassVar[str] = "cpu"
    """The torch device type of its tensors ("cpu", "cuda", "npu"...); custom ops dispatch on it."""
    dist_backend: ClassVar[str] = "gloo"
    """The ``torch.distributed`` backend between its devices."""
    device_control_env_var: ClassVar[str | None] = None
    """The environment variable that limits the visible devices (e.g. ``CUDA_VISIBLE_DEVICES``)."""

    # -- capabilities, as data ----------------------------------------------------------------
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    """Compute dtypes, preferred first (the first is ``preferred_dtype``'s default)."""
    supported_quantization: ClassVar[tuple[str, ...]] = ()
    """Weight quantization methods it keeps quantized in memory, among "gguf" (a GGUF file's
    blocks), "int8" and "int4" (a float model quantized on load); ``get_quant_config`` supplies
    the layers' methods. Empty: weights are dense (a GGUF file is dequantized at load)."""
    supports_graph_capture: ClassVar[bool] = False
    """Whether ``graph_wrapper_cls`` captures graphs (False: it runs eagerly)."""
    config_section: ClassVar[type | None] = None
    """A frozen dataclass of the platform's own settings, filled from
    ``--plugin-config '{"<platform name>": {...}}'`` (read them with
    ``PLUGIN_CONFIG_REGISTRY.get(name, config)``)."""

    # -- device ---------------------------------------------------------------------------------
    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def get_device(cls, local_rank: int = 0) -> torch.device:
        """The torch device of ``local_rank``."""
        return (
            torch.device(cls.device_type, local_rank)
            if cls.device_type != "cpu"
            else (torch.device("cpu"))
        )

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Make ``device`` current in this process."""

    @classmethod
    def mem_get_info(cls, device: torch.device) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of ``device``."""
        raise NotImplementedError(f"platform {cls.name!r} does not report memory")

    @classmethod
    def synchronize(cls, device: torch.device | None = None) -> None:
        """Wait for the device's queued work."""

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        """Seed Python's, NumPy's and torch's random state (device generators included)."""
        import numpy as np

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    @classmethod
    def register_ops(cls) -> None:
        """Register the platform's custom-op implementations (``register_impl``). Runs once per
        process, in the register phase, after the general plugins."""

    @classmethod
    def device_info(cls) -> dict[str, Any]:
        """What the platform found on this machine (instruction sets, device names...), as a
        JSON-ready dict; ``kiln plugins`` and ``/debug/plugins`` show it. Must not change any
        state."""
        return {}

    @classmethod
    def init_process(cls, role: str, config: KilnConfig) -> None:
        """Called once in every Kiln process after configure, with its role (``api``: beside
        ``kiln serve``'s HTTP server or ``kiln plugins``; ``engine``: the engine process beside an
        API server; ``worker``; ``offline``: an ``LLM`` in the caller's process). For process-wide
        settings such as where the API server runs; device set-up belongs in
        ``init_worker_process``.

        Raises:
            ValueError: a setting that cannot be honoured on this machine.
        """

    @classmethod
    def init_worker_process(cls, config: KilnConfig) -> None:
        """Called once in each worker process before the device is used: thread pools,
        allocator settings, environment for the device runtime."""

    @classmethod
    @contextlib.contextmanager
    def inference_mode(cls) -> Iterator[None]:
        """The autograd mode model execution runs under."""
        with torch.inference_mode():
            yield

    @classmethod
    def get_quant_config(cls, method: str, config: KilnConfig) -> QuantizationConfig:
        """The ``QuantizationConfig`` that keeps the model's weights quantized by ``method`` (one
        of ``supported_quantization``), built once per model load.

        Its ``get_linear_method(layer, prefix)`` gives each linear layer (and, for "gguf", the
        token embedding and LM head) a ``LinearMethodBase`` (``kiln.model_executor.layers.linear``)
        that owns the layer's parameters and product. The default returns Kiln's reference
        methods (``kiln.model_executor.layers.quantization``: GGUF blocks dequantized per call,
        int8 / int4 dequantized per call), correct but slow; a platform overrides
        ``pack`` / ``matmul`` / ``embed`` of their subclasses with its kernels.

        Raises:
            ValueError: ``method`` is not in ``supported_quantization``.
        """
        from kiln.model_executor.layers.quantization import reference_quant_config

        if method not in cls.supported_quantization:
            raise ValueError(
                f"model.quantization={method!r} is not supported on platform {cls.name!r}; "
                f"allowed: {['auto', 'none', *cls.supported_quantization]}"
            )
        return reference_quant_config(method)

    # -- config -----------------------------------------------------------------------------------
    @classmethod
    def check_and_update_config(cls, config: KilnConfig) -> KilnConfig:
        """Validate ``config`` for this platform and return it with what the platform changes.

        The default fills every class field left at ``"auto"`` from the factories below and
        resolves ``dtype="auto"``. Overrides should call ``super()`` and return a config made with
        ``config.replace(...)``; Kiln records every field that changed for ``kiln plugins``.

        Raises:
            ValueError: a setting this platform cannot honour (name the field and the allowed
                values).
        """
        changes: dict[str, object] = {}
        for name, spec in CLASS_FIELDS.items():
            if getattr(config.device, name) == AUTO:
                factory = getattr(cls, spec.factory)
                # Some defaults depend on the config (batch-invariant mode, speculative method).
                args = (config,) if spec.takes_config else ()
                changes[f"device__{name}"] = factory(*args)
        if config.model.dtype == "auto":
            changes["model__dtype"] = cls.auto_dtype(config)
        elif config.model.dtype not in cls.supported_dtypes:
            raise ValueError(
                f"model.dtype={config.model.dtype!r} is not supported on platform {cls.name!r}; "
                f"allowed: {['auto', *cls.supported_dtypes]}"
            )
        quantization = config.model.quantization
        if quantization in ("gguf", "int8", "int4") and quantization not in (
            cls.supported_quantization
        ):
            raise ValueError(
                f"model.quantization={quantization!r} is not supported on platform {cls.name!r}; "
                f"allowed: {['auto', 'none', *cls.supported_quantization]}"
            )
        return config.replace(**changes) if changes else config

    @classmethod
    def preferred_dtype(cls, config: KilnConfig) -> str:
        """The compute dtype this platform runs best, which ``dtype="auto"`` takes for a float32
        checkpoint or one that names no dtype: ``supported_dtypes[0]`` unless overridden."""
        return cls.supported_dtypes[0]

    @classmethod
    def auto_dtype(cls, config: KilnConfig) -> str:
        """What ``dtype="auto"`` means for ``config``'s model here, as in vLLM: a bfloat16 or
        float16 checkpoint keeps its precision; a float32 one (or one naming none: a quantized
        GGUF file) runs in ``preferred_dtype``. A checkpoint dtype that is not in
        ``supported_dtypes`` also gets ``preferred_dtype``. Logs the choice where it is not the
        checkpoint's own dtype.

        Raises:
            ValueError: no loader reads the model.
        """
        from kiln.model_executor.model_loader import checkpoint_dtype

        saved = checkpoint_dtype(config.model.model, config.model.load_format)
        preferred = cls.preferred_dtype(config)
        if saved in ("bfloat16", "float16") and saved in cls.supported_dtypes:
            return saved
        if saved is not None and saved != preferred:
            if saved in cls.supported_dtypes:  # float32: halved, as vLLM halves it
                why = f"as vLLM runs float32 checkpoints; --dtype {saved} keeps it"
            else:
                why = f"platform {cls.name!r} runs only {list(cls.supported_dtypes)}"
            logger.info("dtype auto: the checkpoint is %s; running %s (%s)", saved, preferred, why)
        return preferred

    # -- factories: dotted paths, resolved lazily by the core ---------------------------------
    @classmethod
    def get_worker_cls(cls) -> str:
        return "kiln.worker.worker.Worker"

    @classmethod
    def get_model_runner_cls(cls) -> str:
        return "kiln.worker.model_runner.ModelRunner"

    @classmethod
    def get_scheduler_cls(cls) -> str:
        return "kiln.scheduler.scheduler.Scheduler"

    @classmethod
    def get_attn_backend_cls(cls, config: KilnConfig) -> str:
        raise NotImplementedError(f"platform {cls.name!r} names no attention backend")

    @classmethod
    def get_communicator_cls(cls) -> str:
        return "kiln.distributed.communicator.TorchDistCommunicator"

    @classmethod
    def get_graph_wrapper_cls(cls) -> str:
        return "kiln.worker.graph.EagerGraphWrapper"

    @classmethod
    def get_proposer_cls(cls, config: KilnConfig) -> str:
        """The speculative-decoding proposer for ``config.speculative.method`` (named even when
        speculation is off, so ``kiln plugins`` shows and checks it)."""
        if config.speculative.method == "draft_model":
            return "kiln.spec_decode.draft_model.DraftModelProposer"
        return "kiln.spec_decode.ngram.NgramProposer"

    @classmethod
    def get_rejection_sampler_cls(cls) -> str:
        return "kiln.spec_decode.rejection_sampler.RejectionSampler"


def api_major(version: str) -> int:
    """The MAJOR of ``"MAJOR.MINOR"``.

    Raises:
        ValueError: not of that form.
    """
    major, _, _minor = str(version).partition(".")
    if not major.isdigit():
        raise ValueError(f"api_version={version!r} is not of the form 'MAJOR.MINOR'")
    return int(major)
