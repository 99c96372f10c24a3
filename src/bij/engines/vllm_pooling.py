"""Engine vllm for the pooling tasks classify, score and rerank: `LLM.classify` and `LLM.score` on vLLM's
pooling runner (the runner embed uses), over a chunk at once (vLLM schedules it).

The rows' pairs, their token counts and the result fields are the ones `pooling` makes for the
transformers and sentence-transformers engines: the same rows get the same answers from any of them.
"""

from __future__ import annotations

from typing import Any

from bij.engines.base import EngineConfig
from bij.engines.pooling import _PairEngine
from bij.engines.vllm_llm import close_llm, llm_kwargs, shared_llm


class VllmPoolingEngine(_PairEngine):
    """A sequence-classification model (classify) or a cross-encoder (score, rerank) served by vLLM."""

    name = "vllm"
    schedules_itself = True  # the worker hands it a whole chunk; vLLM batches the pairs itself

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        llm_kwargs(config)  # a missing model name fails here, before any GPU work
        self.llm: Any = None

    def load(self) -> None:
        """Build (or reuse) the process's LLM on the pooling runner."""
        if self.llm is not None:
            return
        llm = shared_llm(self.config)
        model_config = llm.llm_engine.model_config
        hf = model_config.hf_config
        self._check_labels(str(self.config.name), int(getattr(hf, "num_labels", 1)))
        self._id2label = {int(k): str(v) for k, v in (getattr(hf, "id2label", None) or {}).items()}
        limits = [n for n in (model_config.max_model_len, self.config.max_input_tokens) if n]
        self._limit = min(limits) if limits else None
        self.device = "cuda"
        self.tokenizer = llm.get_tokenizer()
        self.llm = llm

    def close(self) -> None:
        """Stop the process's LLM (close_llm), once loaded; again: nothing."""
        if self.llm is None:
            return
        self.llm = None
        close_llm()

    def batch_shape(self) -> tuple[int, int]:
        """Pairs per call to vLLM: a chunk's worth, which vLLM schedules by its own token budget."""
        return (1 << 16, 1 << 24)

    def _outputs(self, pairs: list[tuple[str, str | None]]) -> list[list[float]]:
        cut = {"truncation": True, "max_length": self._limit} if self.config.truncate and self._limit else None
        if self.config.task == "classify":
            outs = self.llm.classify([a for a, _ in pairs], use_tqdm=False, tokenization_kwargs=cut)
            return [[float(p) for p in o.outputs.probs] for o in outs]
        outs = self.llm.score([a for a, _ in pairs], [b or "" for _, b in pairs], use_tqdm=False,
                              tokenization_kwargs=cut)
        return [[float(o.outputs.score)] for o in outs]
