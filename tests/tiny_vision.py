"""A tiny LLaVA (CLIP vision tower, projector, Llama) with random weights, built on the spot (no download).

Its processor is made from local pieces: the word-level tokenizer of tiny_models.py plus an
``<image>`` token, a CLIP image processor that scales every image to 56 x 56 pixels, and a chat
template that puts one ``<image>`` per image part. 56 / 14-pixel patches make 16 image features,
so vLLM expands each ``<image>`` to 16 tokens. Head size 64, as vLLM's CPU attention needs.
"""

from __future__ import annotations

import io
from pathlib import Path

from tiny_models import BOS, EOS, PAD, VOCAB

IMAGE_TOKEN = "<image>"
VISION_VOCAB = [*VOCAB, IMAGE_TOKEN]
VISION_IDS = {w: i for i, w in enumerate(VISION_VOCAB)}
IMAGE_SIZE, PATCH_SIZE = 56, 14
IMAGE_FEATURES = (IMAGE_SIZE // PATCH_SIZE) ** 2  # the CLS feature is dropped ("default" strategy)

VISION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image> {% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)


def build_vision_model(path: Path, max_positions: int = 320) -> Path:
    """Save a tiny random-weight LLaVA, its tokenizer and its processor to `path`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    tk = Tokenizer(models.WordLevel(vocab=VISION_IDS, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tk.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", extra_special_tokens={"image_token": IMAGE_TOKEN})
    tokenizer.chat_template = VISION_TEMPLATE
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                                                                "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                               vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1, chat_template=VISION_TEMPLATE)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=1, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                                       projection_dim=64),
        text_config=LlamaConfig(vocab_size=len(VISION_VOCAB), hidden_size=128, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                max_position_embeddings=max_positions, bos_token_id=BOS, eos_token_id=EOS,
                                pad_token_id=PAD, tie_word_embeddings=False),
        image_token_index=VISION_IDS[IMAGE_TOKEN],
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    LlavaForConditionalGeneration(config).save_pretrained(path)
    _legacy_layout(path / "model.safetensors")
    return path


def _legacy_layout(weights: Path) -> None:
    """Rename the CLIP tower's weights to the layout of LLaVA checkpoints on the Hub, which vLLM
    loads (``vision_tower.vision_model.*``; transformers 5 saves ``vision_tower.*``)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):]
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, weights, metadata={"format": "pt"})


def png(color: tuple[int, int, int], size: int = 32) -> bytes:
    """A plain PNG of one colour (any size: the processor scales it)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), color).save(out, format="PNG")
    return out.getvalue()
