"""Every model of the integration lane, in the table's order."""

from . import equinox_decoder, fusedar_layer, hf_flax_llama, maxtext_llama, nnx_explicit

MODELS = [
    *maxtext_llama.MODELS,
    *hf_flax_llama.MODELS,
    *nnx_explicit.MODELS,
    *equinox_decoder.MODELS,
    *fusedar_layer.MODELS,
]
