"""Tiny Llama models built on the spot, for the engine tests and the vLLM tier (no downloads).

The "successor" model is wired by hand so that greedy decoding is known in advance:
each token's only successor is the next word of a fixed chain (a b c d e f g h </s>),
so outputs, token counts and row order can be checked exactly.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
TEMPLATE_WORDS = ["user", "assistant", "system", ":"]
CHAIN = ["a", "b", "c", "d", "e", "f", "g", "h"]
OTHER = ["x", "y", "z"]
VOCAB = SPECIALS + TEMPLATE_WORDS + CHAIN + OTHER
IDS = {w: i for i, w in enumerate(VOCAB)}
PAD, BOS, EOS = IDS["<pad>"], IDS["<s>"], IDS["</s>"]
MAX_POSITIONS = 64

CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('the first message must not be from the assistant') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def successor(word: str) -> str:
    """The successor model's only continuation of `word`."""
    if word in CHAIN[:-1]:
        return CHAIN[CHAIN.index(word) + 1]
    if word == ":":  # the end of the chat prompt: answers start at f
        return "f"
    return "</s>"


def chain_after(word: str) -> list[str]:
    """Words the successor model generates after `word`, EOS not included."""
    out = []
    while (word := successor(word)) != "</s>":
        out.append(word)
    return out


def build_model(path: Path, *, wired: bool = True, pad_token: bool = True, chat_template: bool = True,
                max_positions: int = MAX_POSITIONS) -> Path:
    """Save a tiny Llama and its word-level tokenizer to `path`.

    wired=True: attention and MLP outputs are zero, embeddings are one-hot, and the LM
    head maps each token to its successor, so the next token depends on the last token only.
    wired=False: random weights (for determinism and sampling checks).
    Head size 64 keeps the model within vLLM's attention kernels' supported sizes.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab=IDS, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tk.decoder = decoders.WordPiece()
    specials: dict[str, str] = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if pad_token:
        specials["pad_token"] = "<pad>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, **specials)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=128, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD if pad_token else None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    if wired:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.model.embed_tokens.weight.zero_()
            model.lm_head.weight.zero_()
            for word, i in IDS.items():
                model.model.embed_tokens.weight[i, i] = 1.0
                model.lm_head.weight[IDS[successor(word)], i] = 10.0
    model.save_pretrained(path)
    return path


# The marker model: one token per character (any ASCII text, JSON and tool-call markup included) and
# a reasoning model's <think> and </think> tokens; wired so that greedy decoding after a chat prompt
# ("...assistant:") thinks "ok" and answers "yes": <think> o k </think> y e s </s>. Where a
# constraint forbids the wired successor, the first allowed token (lowest id) wins: the output is
# known in advance too.
MARKER_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
THINK, END_THINK = "<think>", "</think>"
# Whitespace last: where a JSON constraint allows it, the first allowed token is never a space, so a
# constrained answer does not pad itself out to its token cap.
MARKER_VOCAB = MARKER_SPECIALS + [THINK, END_THINK] + [chr(i) for i in range(33, 127)] + [" ", "\n"]
MARKER_CHAIN = {":": THINK, THINK: "o", "o": "k", "k": END_THINK, END_THINK: "y", "y": "e", "e": "s"}
# Tools as a hermes-style template shows them; earlier calls as <tool_call> JSON; thinking off
# (enable_thinking false, as reasoning_effort "none" asks) closes the reasoning in the prompt.
MARKER_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{{ tools | tojson }}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}:{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def build_marker_model(path: Path, max_positions: int = 320) -> Path:
    """Save the marker model (see MARKER_CHAIN) and its character-level tokenizer to `path`."""
    import torch
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    ids = {w: i for i, w in enumerate(MARKER_VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_tokens([AddedToken(THINK, normalized=False), AddedToken(END_THINK, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>")
    tokenizer.chat_template = MARKER_TEMPLATE
    tokenizer.save_pretrained(path)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(MARKER_VOCAB), hidden_size=128, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for word, i in ids.items():
            model.model.embed_tokens.weight[i, i] = 1.0
            model.lm_head.weight[ids[MARKER_CHAIN.get(word, "</s>")], i] = 10.0
    model.save_pretrained(path)
    return path


# Labels of the tiny classifier, named as a real model's config.id2label names them.
CLASSIFIER_LABELS = {0: "negative", 1: "neutral", 2: "positive"}
BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *CHAIN, *OTHER, "the", "cat", "dog", "sat", "ran",
              "on", "mat", "fast", "what", "is", "a", "pet"]


def build_bert_head(path: Path, *, num_labels: int, id2label: dict[int, str] | None = None,
                    max_positions: int = MAX_POSITIONS, hidden_size: int = 32) -> Path:
    """Save a tiny BERT with a sequence-classification head (random weights) and its WordPiece tokenizer:
    a classifier with `id2label`, or with one label a cross-encoder as sentence-transformers' CrossEncoder
    loads it (the pair as [CLS] a [SEP] b [SEP]). vLLM's CPU attention wants heads of 64: hidden_size=128."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    ids = {w: i for i, w in enumerate(dict.fromkeys(BERT_WORDS))}
    tk = Tokenizer(models.WordPiece(vocab=ids, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    PreTrainedTokenizerFast(tokenizer_object=tk, model_max_length=max_positions, unk_token="[UNK]",
                            pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                            mask_token="[MASK]",
                            model_input_names=["input_ids", "token_type_ids", "attention_mask"]).save_pretrained(path)
    torch.manual_seed(1)
    labels = id2label or {i: f"LABEL_{i}" for i in range(num_labels)}
    config = BertConfig(vocab_size=len(ids), hidden_size=hidden_size, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
                        num_labels=num_labels, initializer_range=0.2, id2label=labels,
                        label2id={v: k for k, v in labels.items()})
    BertForSequenceClassification(config).eval().save_pretrained(path)
    return path
