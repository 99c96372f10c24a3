"""The pooling tasks on a sequence-classification head: classify, score and rerank.

- classify: the row's text through the head; `probs` is the softmax over its labels (a sigmoid for a
  one-label head), `label` the most likely one named by the model's `config.id2label`.
- score: the pair (text, pair) through a one-label head, the logit through a sigmoid, as
  sentence-transformers' CrossEncoder and vLLM's score do for a cross-encoder.
- rerank: each (query, document) pair scored so; `results` are `{index, relevance_score}`, best first.

Two loaders share that: `SequenceClassifierEngine` (transformers' AutoModelForSequenceClassification, engine
transformers, and sentence-transformers' classify) and `CrossEncoderEngine` (sentence-transformers'
CrossEncoder, its own activation and truncation, for score and rerank).

A row's token count is its longest pair's, special tokens included: the limit holds for every pair,
and with `config.truncate` each pair is cut to it as the tokenizer cuts pairs (longest first).
"""

from __future__ import annotations

from typing import Any

from bij.contract.engines import POOLING_TASKS
from bij.engines import hub
from bij.engines.base import EngineBase, EngineConfig, Request, Result
from bij.engines.prompts import pick_device


def row_pairs(task: str, req: Request) -> list[tuple[str, str | None]]:
    """The texts one row sends through the head: its text (classify), (text, pair) or (query, document) each."""
    text = req.text or ""
    if task == "score":
        return [(text, req.pair or "")]
    if task == "rerank":
        return [(text, doc) for doc in req.documents or []]
    return [(text, None)]


def pooled(task: str, outputs: list[list[float]], id2label: dict[int, str]) -> dict[str, Any]:
    """A row's result fields from its pairs' activated outputs (probabilities, or one score a pair)."""
    if task == "classify":
        probs = outputs[0]
        best = max(range(len(probs)), key=probs.__getitem__)
        return {"label": id2label.get(best, str(best)), "probs": probs}
    if task == "score":
        return {"score": outputs[0][0]}
    order = sorted(range(len(outputs)), key=lambda i: -outputs[i][0])
    return {"results": [{"index": i, "relevance_score": outputs[i][0]} for i in order]}


class _PairEngine(EngineBase):
    """What both loaders share: pairs per row, counting, the limit, sub-batches of pairs, result rows."""

    parallel_prepare = True  # torch lets go of the interpreter: parse the next chunks meanwhile
    schedules_itself = False
    continuous = False
    honours: frozenset[str] = frozenset()  # no sampling: a pooling task has nothing to sample

    def __init__(self, config: EngineConfig):
        if config.task not in POOLING_TASKS:
            raise ValueError(f"{type(self).__name__} runs tasks {', '.join(POOLING_TASKS)}, not {config.task!r}")
        self.config = config
        self.tokenizer: Any = None
        self.device = "cpu"
        self._limit: int | None = None
        self._id2label: dict[int, str] = {}

    def _check_labels(self, name: str, num_labels: int) -> None:
        if self.config.task != "classify" and num_labels != 1:
            raise ValueError(f"model {name!r} has {num_labels} labels; task {self.config.task} needs a cross-encoder "
                             "with one (a relevance score), use task classify for a classifier")

    def batch_shape(self) -> tuple[int, int]:
        """(rows, padded tokens) per batch when the spec leaves them out, by device."""
        device = self.device if self.tokenizer is not None else pick_device(self.config.device)
        return (256, 65536) if device.startswith("cuda") else (32, 8192)

    def _loaded(self) -> None:
        if self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__}.load() must run before count_tokens() or run()")

    def max_input_tokens(self) -> int | None:
        """The model's limit (its positions, or the cross-encoder's max_length), or config.max_input_tokens."""
        self._loaded()
        return self._limit

    def _tokenize(self, pairs: list[tuple[str, str | None]], **kwargs: Any) -> Any:
        """The tokenizer on the pairs: first texts, and second texts where the task has them."""
        seconds = [b for _, b in pairs]
        return self.tokenizer([a for a, _ in pairs], seconds if seconds[0] is not None else None, **kwargs)

    def _set_limit(self, model_config: Any, tokenizer: Any, *more: int | None) -> None:
        """The input limit: the smallest that is set of the model's positions, the tokenizer's length,
        `more` (the loader's own) and config.max_input_tokens."""
        positions = getattr(model_config, "max_position_embeddings", None)
        tok_max = tokenizer.model_max_length if tokenizer.model_max_length < 1 << 30 else None
        limits = [n for n in (positions, tok_max, *more, self.config.max_input_tokens) if n]
        self._limit = min(limits) if limits else None

    def _counts(self, pairs: list[tuple[str, str | None]]) -> list[int]:
        if not pairs:
            return []
        enc = self._tokenize(pairs, add_special_tokens=True, padding=False, truncation=False,
                             return_attention_mask=False, return_token_type_ids=False, verbose=False)
        return [len(ids) for ids in enc["input_ids"]]

    def count_tokens(self, requests: list[Request]) -> list[int]:
        """Tokens of each row's longest pair, special tokens included, untruncated."""
        self._loaded()
        per_row = [row_pairs(self.config.task, r) for r in requests]
        counts = iter(self._counts([p for pairs in per_row for p in pairs]))
        return [max([next(counts) for _ in pairs], default=0) for pairs in per_row]

    def run(self, requests: list[Request]) -> list[Result]:
        """Each row's pairs through the head (in sub-batches of the preferred batch size); a row over the
        limit without `config.truncate` is an error row (the worker refuses those before they get here)."""
        self._loaded()
        task, limit = self.config.task, self._limit
        per_row = [row_pairs(task, r) for r in requests]
        flat = [p for pairs in per_row for p in pairs]
        counts = self._counts(flat)
        if limit is not None and self.config.truncate:
            counts = [min(n, limit) for n in counts]
        outputs: list[list[float]] = []
        step = self.batch_shape()[0]
        for start in range(0, len(flat), step):
            outputs.extend(self._outputs(flat[start:start + step]))
        results: list[Result] = []
        at = 0
        for pairs in per_row:
            n = len(pairs)
            rows_counts, rows_outputs = counts[at:at + n], outputs[at:at + n]
            at += n
            longest = max(rows_counts, default=0)
            if limit is not None and longest > limit:
                results.append(Result(prompt_tokens=longest, error=f"input is {longest} tokens, longer than the "
                                      f"model's limit of {limit}", extra={"code": "too_many_tokens"}))
                continue
            results.append(Result(prompt_tokens=sum(rows_counts), pooled=pooled(task, rows_outputs, self._id2label)))
        return results

    def _outputs(self, pairs: list[tuple[str, str | None]]) -> list[list[float]]:
        """Activated outputs of each pair: class probabilities (classify) or [score]."""
        raise NotImplementedError


class SequenceClassifierEngine(_PairEngine):
    """A sequence-classification model loaded with AutoModelForSequenceClassification (a local path or a
    hub id): classify, or score and rerank with a one-label head (a cross-encoder)."""

    name = "transformers"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.model: Any = None

    def load(self) -> None:
        """Load tokenizer and model once; later calls are no-ops."""
        if self.model is not None:
            return
        name = str(self.config.name)
        local_only = hub.local_files_only(name)
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        with hub.loading(name):
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
            model: Any = AutoModelForSequenceClassification.from_pretrained(name, local_files_only=local_only)
        self._check_labels(name, model.config.num_labels)
        if tokenizer.pad_token_id is None:  # a decoder's head reads the last token that is not padding
            if tokenizer.eos_token_id is None:
                raise ValueError(f"model {name!r}: tokenizer has neither a pad nor an eos token to pad batches")
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.device = pick_device(self.config.device)
        model.to(self.device)
        model.eval()
        self._id2label = {int(k): str(v) for k, v in (model.config.id2label or {}).items()}
        self._set_limit(model.config, tokenizer)
        self.model = model
        self.tokenizer = tokenizer

    def _outputs(self, pairs: list[tuple[str, str | None]]) -> list[list[float]]:
        import torch

        enc = self._tokenize(pairs, padding=True, truncation=self._limit is not None, max_length=self._limit,
                             return_tensors="pt")
        with torch.inference_mode():
            logits = self.model(**enc.to(self.device)).logits.float()
        acts = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
        out: list[list[float]] = acts.cpu().tolist()
        return out


class CrossEncoderEngine(_PairEngine):
    """A sentence-transformers CrossEncoder (a local path or a hub id), tasks score and rerank: its
    `predict` scores each pair with the model's own activation (a sigmoid for one label)."""

    name = "sentence-transformers"

    def __init__(self, config: EngineConfig):
        if config.task == "classify":
            raise ValueError("engine sentence-transformers runs task classify with SequenceClassifierEngine")
        super().__init__(config)
        self.model: Any = None

    def load(self) -> None:
        """Load the cross-encoder once; later calls are no-ops."""
        if self.model is not None:
            return
        name = str(self.config.name)
        local_only = hub.local_files_only(name)
        from sentence_transformers import CrossEncoder

        self.device = pick_device(self.config.device)
        with hub.loading(name):
            model = CrossEncoder(name, device=self.device, local_files_only=local_only)
        self._check_labels(name, model.config.num_labels)
        self.tokenizer = model.tokenizer
        # sentence-transformers 5.x calls it max_seq_length (max_length before, a deprecated alias now).
        length_name = "max_seq_length" if hasattr(model, "max_seq_length") else "max_length"
        self._set_limit(model.config, self.tokenizer, getattr(model, length_name))
        # predict() cuts every pair to it, as the tokenizer cuts pairs.
        setattr(model, length_name, self._limit)
        self.model = model

    def _outputs(self, pairs: list[tuple[str, str | None]]) -> list[list[float]]:
        scores = self.model.predict([(a, b or "") for a, b in pairs], batch_size=len(pairs), show_progress_bar=False,
                                    convert_to_numpy=True)
        return [[float(s)] for s in scores.reshape(len(pairs), -1)[:, 0].tolist()]
