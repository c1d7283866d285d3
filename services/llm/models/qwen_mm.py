"""The language models inside Qwen2-VL, Qwen2.5-VL and Qwen2-Audio checkpoints.

Each is the Qwen2 decoder; what differs is data: which checkpoint tensors
belong to the language model (only those are opened, so the LLM pod never
reads the vision or audio tower) and how their names map onto the module tree.
Both layouts load:

    Qwen2-VL / 2.5-VL  hub:            model.{embed_tokens,layers,norm}.*, lm_head.*     (visual.* not read)
                       transformers 5: model.language_model.*, lm_head.*                (model.visual.* not read)
    Qwen2-Audio        hub:            language_model.model.*, language_model.lm_head.*
                       transformers 5: model.language_model.*, lm_head.*
                       (audio_tower.* / multi_modal_projector.*, with or without model., not read)

Qwen2-VL / 2.5-VL rotate with M-RoPE: positions are (3, T) (temporal, height,
width; see services/llm/mrope.py), the frequency bands split by ``mrope_section``.
"""

from __future__ import annotations

from modalmesh.weights import LEGACY_BUFFERS, WeightsMapper
from services.llm.models.llama import Qwen2ForCausalLM

_LM_OF_VL = WeightsMapper(prefix={"model.language_model.": "model."}) | LEGACY_BUFFERS
_LM_OF_AUDIO = WeightsMapper(prefix={"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                                     "model.language_model.": "model."}) | LEGACY_BUFFERS


class Qwen2VLTextForCausalLM(Qwen2ForCausalLM):
    architectures = ("Qwen2VLForConditionalGeneration",)
    model_types = ("qwen2_vl",)
    uses_mrope = True
    checkpoint_prefixes = ("model.embed_tokens.", "model.layers.", "model.norm.", "model.language_model.", "lm_head.")
    weights_mapper = _LM_OF_VL


class Qwen2_5_VLTextForCausalLM(Qwen2VLTextForCausalLM):
    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    model_types = ("qwen2_5_vl",)


class Qwen2AudioTextForCausalLM(Qwen2ForCausalLM):
    architectures = ("Qwen2AudioForConditionalGeneration",)
    model_types = ("qwen2_audio",)
    checkpoint_prefixes = ("language_model.", "model.language_model.", "lm_head.")
    weights_mapper = _LM_OF_AUDIO
