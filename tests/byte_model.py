"""A tiny random-weight Llama with a byte-level BPE tokenizer, built in the test run (no download).

Byte-level, so any text has tokens (JSON for structured output, words for LoRA); random, so
what steers its output is the constraint or the adapter under test, never the weights.
"""

from __future__ import annotations

from pathlib import Path


def build_byte_model(path: Path) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer: any text, JSON included, has tokens."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(['{"answer": "yes", "ok": true}', "the quick brown fox jumps"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def build_lora(base: Path, path: Path, seed: int) -> Path:
    """A random LoRA adapter for `base`, saved as PEFT saves one (nonzero B: it changes the output)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(path)
    return path
