"""Token embedding, the LM head, and the logits processor.

Contract:
- ``VocabParallelEmbedding(vocab, hidden)(input_ids [T]) -> [T, hidden]``.
- ``ParallelLMHead(vocab, hidden)`` holds the output projection ``weight`` [vocab, hidden]; it is
  never called directly. With ``tie_word_embeddings`` a model calls ``lm_head.tie_weights(embed)``
  so both share one parameter.
- Given a ``quant_config`` (``QuantizationConfig``), both ask it for a method
  (``get_linear_method``); a method given keeps the table in its own form (GGUF blocks, say):
  the embedding looks rows up with ``quant_method.embedding`` and the logits processor
  multiplies with ``quant_method.apply``. A tied LM head shares the embedding's method and
  storage (``weight_layer()``).
- ``LogitsProcessor(vocab)(lm_head, hidden_states [N, hidden]) -> [N, vocab]`` float32 logits.
  It computes only the rows it is given: the caller (the model runner) selects the rows it needs
  (the last scheduled token of each request) before calling, so a 2,000-token prefill costs one
  row of the vocabulary matmul, not 2,000. The matmul runs in the model's dtype (converting the
  whole ``[vocab, hidden]`` matrix to float32 each step would cost more than the product); the
  result is returned in float32 for the sampler. Built under ``model.batch_invariant``, it has
  ``batch_invariant = True``, with the same meaning as the linear layers' (``linear``).

Tensor parallelism: built inside ``set_tp_group`` (``kiln.distributed.parallel_state``), the
vocabulary is padded to a multiple of ``tp_size`` and rank ``r`` holds rows ``[r * n, (r + 1) *
n)`` of the table (``n`` = padded vocab / ``tp_size``; padding rows are zeros). The embedding
looks up the ids in its range, zeroes the others and all-reduces; the logits processor
all-gathers the ranks' logits and cuts them back to the vocabulary. The collectives run outside
the dispatched ops. Quantized tables are refused with more than one rank (``linear``). This module
knows nothing about models, sampling or checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.parallel_state import tp_group_for
from kiln.model_executor.custom_op import CustomOp, register_op
from kiln.model_executor.layers.linear import (
    LinearMethodBase,
    QuantizationConfig,
    batch_invariant_enabled,
    check_unsharded_method,
    default_weight_loader,
    set_weight_attrs,
)


@register_op("vocab_parallel_embedding")
class VocabParallelEmbedding(CustomOp):
    """Embedding table [num_embeddings, embedding_dim]; ``forward(input_ids)`` looks rows up.

    Args:
        num_embeddings: vocabulary size.
        embedding_dim: hidden size.
        params_dtype: the model's compute dtype.
        prefix: the layer's name in the model.
        quant_config: asked for the table's method; None (or no method) -> a dense ``weight``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        tp_size: int | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        group = tp_group_for(tp_size)
        self.tp_group, self.tp_rank, self.tp_size = group, group.rank, group.world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        # This rank's rows of the vocabulary padded to a multiple of tp_size.
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.prefix = prefix
        params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method: LinearMethodBase | None = (
            quant_config.get_linear_method(self, prefix) if quant_config else None
        )
        check_unsharded_method(self.quant_method, self.tp_size, prefix)
        self._tied_to: tuple[VocabParallelEmbedding, ...] = ()
        if self.quant_method is not None:
            # The table is a linear map hidden -> vocab: input size hidden, output size vocab.
            self.quant_method.create_weights(
                self, embedding_dim, [num_embeddings], params_dtype, default_weight_loader
            )
            return
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's rows of the whole table (or bias); rows past the vocabulary are 0."""
        if self.tp_size == 1:
            default_weight_loader(param, loaded_weight, shard_id)
            return
        rows = loaded_weight[self.vocab_start_index : self.vocab_start_index + param.shape[0]]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def weight_layer(self) -> VocabParallelEmbedding:
        """The layer that holds this one's table: itself, or the embedding a head is tied to."""
        return self._tied_to[0] if self._tied_to else self

    def forward_native(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        return F.embedding(input_ids, self.weight)  # [T] -> [T, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        # Ids outside this rank's rows look up row 0 and are zeroed; the sum over ranks then
        # holds every id's row exactly once.
        local_ids = input_ids - self.vocab_start_index
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings_per_partition)
        embeddings = super().forward(local_ids.masked_fill(outside, 0))  # [T, hidden]
        embeddings.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(embeddings)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        embed = cls(100, 32)
        embed.weight.data.copy_(torch.randn(100, 32, generator=generator))
        ids = torch.randint(0, 100, (11,), generator=generator)
        return [(embed, (ids,), {})]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; used through ``LogitsProcessor``, never called itself."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        tp_size: int | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, prefix, tp_size, quant_config)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(
                    self.num_embeddings_per_partition,
                    dtype=params_dtype or torch.get_default_dtype(),
                ),
                requires_grad=False,
            )
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share ``embed_tokens``' weight and method (``tie_word_embeddings``); returns self."""
        self.weight = embed_tokens.weight
        self.quant_method = embed_tokens.quant_method
        # A tuple, so the embedding does not become a submodule of the head.
        self._tied_to = (embed_tokens,) if embed_tokens.quant_method is not None else ()
        return self

    def forward_native(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")


@register_op("logits_processor")
class LogitsProcessor(CustomOp):
    """Hidden states of the selected rows -> float32 logits.

    Args:
        vocab_size: columns of the result (a padded LM head is cut back to it).
        scale: multiplier of the logits (Granite: ``1 / logits_scaling``; 1.0 elsewhere).
    """

    def __init__(self, vocab_size: int, scale: float = 1.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale
        self.batch_invariant = batch_invariant_enabled()

    def forward_native(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` [N, hidden] -> [N, vocab_size] float32."""
        if lm_head.quant_method is not None:
            logits = lm_head.quant_method.apply(lm_head.weight_layer(), hidden_states, lm_head.bias)
        else:
            logits = F.linear(hidden_states, lm_head.weight, lm_head.bias)  # [N, padded vocab]
        logits = logits[..., : self.vocab_size].float()
        if self.scale != 1.0:
            logits.mul_(self.scale)
        return logits

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().forward(lm_head, hidden_states)  # [N, this rank's vocabulary rows]
        if lm_head.tp_size == 1:
            return logits
        # [N, padded vocab] in rank order -> [N, vocab_size]
        return lm_head.tp_group.all_gather(logits, dim=-1)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, scale={self.scale}"

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        examples: list[tuple[CustomOp, tuple, dict]] = []
        for dtype in (torch.float32, torch.bfloat16):
            head = ParallelLMHead(120, 32, params_dtype=dtype)
            head.weight.data.copy_(torch.randn(120, 32, generator=generator))
            op = cls(100)
            # A submodule of the op, so moving the op to a device moves the head passed in args.
            op.example_lm_head = head
            hidden = torch.randn(3, 32, generator=generator).to(dtype)
            examples.append((op, (head, hidden), {}))
        return examples


__all__ = ["LogitsProcessor", "ParallelLMHead", "VocabParallelEmbedding"]
